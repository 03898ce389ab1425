"""How much each scenario does: the full run (what docs/performance.md reports) and the quick one (the tests)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from agent import NodeShape

BASE = NodeShape(gpus=8, replicas=48)
SCALE = NodeShape(gpus=16, replicas=48)


@dataclass(frozen=True, kw_only=True)
class Params:
    mode: str
    repeat: int
    base: NodeShape = BASE
    scale: NodeShape = SCALE
    warmup_calls: int
    allocate_calls: int
    """1-replica Allocate calls timed against the agent, and as many against the floor (in alternating blocks: the
    median and p99 ratios come from these; at least 2,000 a side for a p99)"""
    blocks: int
    memory_calls: int
    """Allocate calls in all before the second RSS reading"""
    bursts: int
    burst_size: int = 48
    switch_reps: int
    scale_calls: int
    health_reps: int
    outages_s: tuple[float, ...]
    """how long the fake kubelet stays away in the re-registration runs beyond the immediate restart"""
    rereg_reps: int
    startup_reps: int
    idle_s: float

    def as_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["base"] = str(self.base)
        out["scale"] = str(self.scale)
        return out


FULL = Params(
    mode="full",
    repeat=3,
    warmup_calls=300,
    allocate_calls=3000,
    blocks=60,
    memory_calls=10_000,
    bursts=30,
    switch_reps=5,
    scale_calls=300,
    health_reps=5,
    outages_s=(2.0, 5.0),
    rereg_reps=3,
    startup_reps=3,
    idle_s=60.0,
)

QUICK = Params(
    mode="quick",
    repeat=1,
    warmup_calls=50,
    allocate_calls=300,
    blocks=3,
    memory_calls=1000,
    bursts=5,
    switch_reps=1,
    scale_calls=20,
    health_reps=1,
    outages_s=(1.0,),
    rereg_reps=1,
    startup_reps=1,
    idle_s=3.0,
)
