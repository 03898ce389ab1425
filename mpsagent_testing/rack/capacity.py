"""Whether any GPU of the rack was ever oversubscribed, from what the API server holds: the agents' ResourceSlices
(what each device offers: `memory`, `compute`) and the claims' allocations (each result's device and its
`consumedCapacity`), with MPS's client limit (each allocated claim on a device is one client, beside the clients of
device-plugin grants the caller names). Checked again at every change of a claim or a slice the API server shows
(a watch of each), so that a state that lasted only between two changes is seen too. Quantities are read here,
not with the agent's parser."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal

from mpsagent_testing.cluster import claims
from mpsagent_testing.rack.rest import Api, Informer, Object

MAX_CLIENTS = 48
"""MPS's clients per GPU from Volta on."""
DIMENSIONS = ("memory", "compute")
_QUANTITY = re.compile(r"^([0-9.]+)([a-zA-Z]*)$")
_SUFFIXES = {
    "": 1,
    "m": Decimal("0.001"),
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
}


def quantity(text: str) -> Decimal:
    """A Kubernetes quantity (`80Gi`, `25`, `85899345920`) as a number."""
    match = _QUANTITY.match(text.strip())
    if match is None or match[2] not in _SUFFIXES:
        raise ValueError(f"not a quantity: {text!r}")
    return Decimal(match[1]) * _SUFFIXES[match[2]]


Device = tuple[str, str]
"""A device by its pool (the node) and name (`gpu-0`)."""


@dataclass(frozen=True)
class Use:
    """What one device holds: memory (bytes), compute (per cent) and clients, and what its slice offers."""

    memory: Decimal
    compute: Decimal
    clients: int
    offered: dict[str, Decimal]

    def over(self) -> list[str]:
        """What is more than the device has, as `what used > offered`; empty when nothing is."""
        found = [
            f"{name} {used} > {offer}"
            for name, used in (("memory", self.memory), ("compute", self.compute))
            if used > (offer := self.offered.get(name, Decimal(0)))
        ]
        if self.clients > MAX_CLIENTS:
            found.append(f"clients {self.clients} > {MAX_CLIENTS}")
        return found

    def fits(self, memory: Decimal, compute: Decimal) -> bool:
        """Whether a claim of `memory` and `compute` fits beside what the device holds."""
        room = self.offered
        return (
            self.memory + memory <= room.get("memory", 0)
            and self.compute + compute <= room.get("compute", 0)
            and self.clients < MAX_CLIENTS
        )


def offered(slice_: Object) -> dict[Device, dict[str, Decimal]]:
    pool = slice_["spec"]["pool"]["name"]
    return {
        (pool, device["name"]): {name: quantity(device["capacity"][name]["value"]) for name in DIMENSIONS}
        for device in slice_["spec"].get("devices", [])
    }


def allocated(claim: Object) -> list[tuple[Device, dict[str, Decimal]]]:
    """The claim's results of the agent's driver: each device and what it consumes of it."""
    allocation = claim.get("status", {}).get("allocation")
    if not allocation:
        return []
    return [
        (
            (result["pool"], result["device"]),
            {k: quantity(v) for k, v in (result.get("consumedCapacity") or {}).items()},
        )
        for result in allocation["devices"].get("results", [])
        if result["driver"] == claims.DRIVER
    ]


def device_use(
    slices: Iterable[Object], claims: Iterable[Object], other_clients: Mapping[Device, int]
) -> dict[Device, Use]:
    """Every device the slices offer or a claim's allocation names: what the claims consume of it, its clients (one
    per claim, and `other_clients`), and what its slice offers (nothing, where no slice offers it)."""
    offers: dict[Device, dict[str, Decimal]] = {}
    for slice_ in slices:
        offers.update(offered(slice_))
    consumed: dict[Device, list[dict[str, Decimal]]] = {device: [] for device in offers}
    for claim in claims:
        for device, consumes in allocated(claim):
            consumed.setdefault(device, []).append(consumes)
    return {
        device: Use(
            memory=sum((c.get("memory", Decimal(0)) for c in each), Decimal(0)),
            compute=sum((c.get("compute", Decimal(0)) for c in each), Decimal(0)),
            clients=len(each) + other_clients.get(device, 0),
            offered=offers.get(device, {}),
        )
        for device, each in consumed.items()
    }


class CapacityWatch:
    """Watches the driver's slices and `namespace`'s claims and checks every device at each change; `other_clients`
    are the clients of device-plugin grants on a device."""

    def __init__(self, api: Api, namespace: str) -> None:
        self._lock = threading.Lock()
        self.other_clients: dict[Device, int] = {}
        self.violations: list[str] = []
        """Each device found over what it offers, with the claims' view at that change."""
        self.highest = {"memory": 0.0, "compute": 0.0, "clients": 0.0}
        """The fullest any device was at any change: memory and compute as fractions of what its slice offered,
        clients as a count."""
        self.checks = 0
        self._slices = Informer(
            api,
            "/apis/resource.k8s.io/v1/resourceslices",
            f"fieldSelector=spec.driver%3D{claims.DRIVER}",
            changed=self._changed,
        )
        self._claims = Informer(
            api, f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims", changed=self._changed
        )

    def start(self) -> CapacityWatch:
        self._slices.start()
        self._claims.start()
        return self

    def stop(self) -> None:
        self._claims.stop()
        self._slices.stop()

    def failure(self) -> BaseException | None:
        """What ended one of its watches, if something did (its checks stopped then)."""
        return self._slices.failure or self._claims.failure

    def claims(self) -> set[str]:
        """The names of the claims the API server holds now."""
        return {claim["metadata"]["name"] for claim in self._claims.objects().values()}

    def use(self) -> dict[Device, Use]:
        """Each device's use now."""
        return device_use(self._slices.objects().values(), self._claims.objects().values(), self.other_clients)

    def fits_somewhere(self, memory: Decimal, compute: Decimal) -> bool:
        """Whether a claim of `memory` and `compute` fits beside what some device holds now."""
        return any(use.fits(memory, compute) for use in self.use().values())

    def _changed(self, kind: str, item: Object) -> None:
        with self._lock:
            self.checks += 1
            for device, use in self.use().items():
                over = use.over()
                if over:
                    self.violations.append(
                        f"{device[0]}/{device[1]} after {kind} {item['metadata']['name']}: " + ", ".join(over)
                    )
                offer = use.offered
                for name, value in (
                    ("memory", use.memory / offer["memory"] if offer.get("memory") else 0),
                    ("compute", use.compute / offer["compute"] if offer.get("compute") else 0),
                    ("clients", use.clients),
                ):
                    self.highest[name] = max(self.highest[name], float(value))
