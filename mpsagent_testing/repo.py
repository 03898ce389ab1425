"""Where the checkout's files are: its root, the examples, the git-ignored build directory of the test stand-ins;
and which commit it is, for the benches' results."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
BUILD = ROOT / "tests" / ".build"
H100_NODE = EXAMPLES / "node-h100x8.yaml"


def commit() -> str:
    """The checkout's commit, short (empty outside a git checkout)."""
    done = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    return done.stdout.strip()
