"""Integers as `--status` reads them back from the status file, bounded.

The file may have been edited, or be another program's: a value outside these bounds is a one-line error naming
the file and the field, not a traceback, a huge number or a negative count. A PID that names no process the agent
can have (-1, 1, above pid_max) reads, and is shown as not running.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

Pid = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
Count = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
