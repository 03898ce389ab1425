"""Entry point: `mpsagent ...` and `python -m mpsagent ...`."""

from __future__ import annotations

import sys

from mpsagent.cli import run


def main() -> None:
    sys.exit(run())


if __name__ == "__main__":
    main()
