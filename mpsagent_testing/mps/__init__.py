"""The MPS control daemon in tests: the real front-end (`daemon`), and `nvidia-cuda-mps-control` here, a fake
binary for the faults the real one cannot show (`FAKE_CONTROL_BIN`)."""

from __future__ import annotations

from pathlib import Path

FAKE_CONTROL_BIN = Path(__file__).with_name("nvidia-cuda-mps-control")
