"""The rack's workload: pods of one ResourceClaim each, of the agent's DeviceClass, asking random memory and compute
(seeded, so that a run can be made again), one in TOO_BIG_EVERY asking more memory than any GPU has; and what the
scheduler said of a pod it did not place."""

from __future__ import annotations

import random
from dataclasses import dataclass
from decimal import Decimal

from mpsagent_testing.cluster import claims
from mpsagent_testing.cluster.layout import BUSYBOX_IMAGE
from mpsagent_testing.rack.rest import Object

MEMORY_GIB = (1, 64)
"""A claim's memory, in whole GiB, drawn evenly: about 2.5 claims fill an 80 GiB GPU."""
COMPUTE = (5, 50)
"""A claim's compute (per cent of the SMs), drawn evenly, for the half of the claims that ask compute; the others
ask none (threads in proportion to their memory)."""
TOO_BIG_GIB = 96
"""More than an 80 GiB GPU has: a claim that fits nowhere."""
TOO_BIG_EVERY = 10
"""Every tenth claim is too big, starting with the first."""
UNSCHEDULABLE = "cannot allocate all claims"
"""What the scheduler's DRA plugin says of a node where a pod's claims find no device."""


@dataclass(frozen=True)
class Size:
    """What one claim asks: memory (GiB), and compute (per cent; None: none)."""

    memory_gib: int
    compute: int | None

    def consumes(self) -> tuple[Decimal, Decimal]:
        """What the claim consumes of its device: memory (bytes) and compute (what it asks, or the device's default
        of 0)."""
        return Decimal(self.memory_gib << 30), Decimal(self.compute or 0)

    @property
    def too_big(self) -> bool:
        return self.memory_gib > MEMORY_GIB[1]

    def requests(self) -> dict[str, str]:
        asked = {"memory": f"{self.memory_gib}Gi"}
        if self.compute is not None:
            asked["compute"] = str(self.compute)
        return asked


class Workload:
    """Pods and their claims of random sizes, named `<prefix>-00001` on."""

    def __init__(self, namespace: str, *, seed: int, prefix: str = "rack") -> None:
        self.namespace = namespace
        self._random = random.Random(seed)
        self._prefix = prefix
        self._made = 0
        self.sizes: dict[str, Size] = {}
        """Each pod's (and its claim's) size, by name."""

    def next(self, size: Size | None = None) -> tuple[str, Size]:
        """The next pod's name and size (`size`, or drawn)."""
        name = f"{self._prefix}-{self._made:05d}"
        size = self._drawn() if size is None else size
        self._made += 1
        self.sizes[name] = size
        return name, size

    def _drawn(self) -> Size:
        if self._made % TOO_BIG_EVERY == 0:
            return Size(TOO_BIG_GIB, None)
        compute = self._random.randint(*COMPUTE) if self._random.random() < 0.5 else None
        return Size(self._random.randint(*MEMORY_GIB), compute)

    def claim(self, name: str, size: Size) -> Object:
        exactly = {"deviceClassName": claims.DEVICE_CLASS, "capacity": {"requests": size.requests()}}
        return {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": self.namespace},
            "spec": {"devices": {"requests": [{"name": claims.CLAIM, "exactly": exactly}]}},
        }

    def pod(self, name: str) -> Object:
        """A pod of the claim of the same name. No kubelet runs it: the scheduler places it, the kubelet stand-in
        prepares its claim."""
        container = {"name": "app", "image": BUSYBOX_IMAGE, "resources": {"claims": [{"name": claims.CLAIM}]}}
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": self.namespace},
            "spec": {
                "containers": [container],
                "resourceClaims": [{"name": claims.CLAIM, "resourceClaimName": name}],
                "automountServiceAccountToken": False,
                "enableServiceLinks": False,
            },
        }


def unschedulable(pod: Object) -> str | None:
    """The scheduler's message on a pod it could not place; None while it has said none."""
    for condition in pod.get("status", {}).get("conditions", []):
        if condition["type"] == "PodScheduled" and condition["status"] == "False":
            return str(condition.get("message", ""))
    return None
