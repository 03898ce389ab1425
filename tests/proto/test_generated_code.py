"""The committed protobuf code is exactly what the pinned compiler generates from protos/."""

from __future__ import annotations

import filecmp
import os
import subprocess
import sys
from pathlib import Path

from mpsagent_testing.repo import ROOT


def _tree(root: Path) -> dict[str, Path]:
    return {str(p.relative_to(root)): p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


def test_committed_proto_code_matches_a_fresh_generation(tmp_path: Path) -> None:
    out = tmp_path / "proto"
    env = {**os.environ, "PYTHON": sys.executable, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    subprocess.run(
        [str(ROOT / "scripts" / "gen_protos.sh"), str(out)], check=True, env=env, timeout=120, capture_output=True
    )
    fresh, committed = _tree(out), _tree(ROOT / "mpsagent" / "_proto")
    assert sorted(fresh) == sorted(committed)
    different = [name for name in fresh if not filecmp.cmp(fresh[name], committed[name], shallow=False)]
    assert different == [], f"regenerate with scripts/gen_protos.sh: {different} differ"
