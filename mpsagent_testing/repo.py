"""Where the checkout's files are: its root, the examples, the git-ignored build directory of the test stand-ins."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
BUILD = ROOT / "tests" / ".build"
H100_NODE = EXAMPLES / "node-h100x8.yaml"
