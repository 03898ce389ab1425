"""A stand-in for PyTorch with CUDA, for bench/gpu_share.py's clients on a machine without a GPU.

The GPU has FAKE_TORCH_SMS streaming multiprocessors (132, an H200); a client whose environment carries
CUDA_MPS_ACTIVE_THREAD_PERCENTAGE sees that share of them, as an MPS client does. A matmul of two n x n matrices
takes 2 n^3 / (SMs seen x 1 GFLOP/s), so the bench's numbers follow the thread cap. Only what the bench calls.
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

bfloat16 = "bfloat16"
FLOPS_PER_SM = 1e9


def _sms() -> int:
    total = int(os.environ.get("FAKE_TORCH_SMS", "132"))
    percentage = os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    return max(1, total * int(percentage) // 100) if percentage else total


class Tensor:
    def __init__(self, n: int) -> None:
        self.n = n


def randn(n: int, m: int, *, device: str, dtype: str) -> Tensor:
    if n != m or not device.startswith("cuda") or dtype != bfloat16:
        raise ValueError(f"fake torch: randn({n}, {m}, device={device!r}, dtype={dtype!r}) is not what the bench does")
    return Tensor(n)


def matmul(a: Tensor, b: Tensor) -> Tensor:
    time.sleep(2 * a.n * b.n * a.n / (_sms() * FLOPS_PER_SM))
    return Tensor(a.n)


def _properties(ordinal: int) -> SimpleNamespace:
    if ordinal != 0:
        raise RuntimeError(f"fake torch: no device {ordinal}")
    return SimpleNamespace(name="Fake H200", multi_processor_count=_sms())


cuda = SimpleNamespace(
    is_available=lambda: True,
    get_device_properties=_properties,
    synchronize=lambda: None,
)
