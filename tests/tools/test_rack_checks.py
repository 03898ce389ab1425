"""What the rack (bench/rack.py, tests/e2e/test_e2e_rack.py) concludes from the API server's objects and its audit
log, on objects and log lines made here: a device over what its slice offers, or over MPS's 48 clients, is found
(so that its `0 oversubscribed` could have said otherwise), and each agent's requests in a window are counted by
kind, its watches held included."""

from __future__ import annotations

import json
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from mpsagent_testing.cluster import claims
from mpsagent_testing.rack.agents import GPU_MEMORY
from mpsagent_testing.rack.audit import AuditLog
from mpsagent_testing.rack.capacity import MAX_CLIENTS, device_use, quantity
from mpsagent_testing.rack.workload import TOO_BIG_EVERY, Workload

GIB = 1 << 30


def rack_slice(node: str, *devices: tuple[str, str, str]) -> dict[str, Any]:
    """A node's slice as the agent publishes it: each device's name, memory and compute offered."""
    listed = [
        {"name": name, "capacity": {"memory": {"value": memory}, "compute": {"value": compute}}}
        for name, memory, compute in devices
    ]
    return {"spec": {"pool": {"name": node}, "devices": listed}}


def claim(node: str, device: str, memory: str, compute: str | None = None) -> dict[str, Any]:
    consumed = {"memory": memory} | ({} if compute is None else {"compute": compute})
    result = {"driver": claims.DRIVER, "pool": node, "device": device, "consumedCapacity": consumed}
    return {"metadata": {"name": f"on-{device}"}, "status": {"allocation": {"devices": {"results": [result]}}}}


SLICES = [rack_slice("rack-00", ("gpu-0", "80Gi", "100"), ("gpu-7", "61440Mi", "75"))]


def test_devices_within_their_offer_are_not_over_and_a_free_one_takes_a_claim_that_fits() -> None:
    held = [claim("rack-00", "gpu-0", "40Gi", "50"), claim("rack-00", "gpu-0", "40Gi", "50")]
    use = device_use(SLICES, held, {("rack-00", "gpu-7"): 1})
    assert use[("rack-00", "gpu-0")].over() == []
    assert (use[("rack-00", "gpu-0")].memory, use[("rack-00", "gpu-0")].clients) == (80 * GIB, 2)
    assert not use[("rack-00", "gpu-0")].fits(Decimal(GIB), Decimal(0)), "the GPU's memory is all taken"
    assert use[("rack-00", "gpu-7")].fits(Decimal(60 * GIB), Decimal(75))
    assert not use[("rack-00", "gpu-7")].fits(Decimal(61 * GIB), Decimal(0)), "a device-plugin grant holds 20 GiB"


@pytest.mark.parametrize(
    ("held", "found"),
    [
        ([claim("rack-00", "gpu-0", "40Gi"), claim("rack-00", "gpu-0", "41Gi")], "memory 86973087744 > 85899345920"),
        ([claim("rack-00", "gpu-7", "1Gi", "50"), claim("rack-00", "gpu-7", "1Gi", "26")], "compute 76 > 75"),
        ([claim("rack-00", "gpu-7", "1Mi")] * MAX_CLIENTS, f"clients 49 > {MAX_CLIENTS}"),
        ([claim("rack-01", "gpu-0", "1Gi")], "memory 1073741824 > 0"),
    ],
    ids=["memory", "compute", "clients beside a device-plugin grant", "a device no slice offers"],
)
def test_a_device_over_its_offer_or_the_client_limit_is_found(held: list[dict[str, Any]], found: str) -> None:
    use = device_use(SLICES, held, {("rack-00", "gpu-7"): 1})
    assert [problem for device in use.values() for problem in device.over()] == [found]


def test_quantities_are_read_as_the_api_server_writes_them() -> None:
    assert [quantity(text) for text in ("80Gi", "61440Mi", "85899345920", "25", "1500m", "2k")] == [
        80 * GIB, 60 * GIB, 85899345920, 25, Decimal("1.5"), 2000,
    ]  # fmt: skip
    with pytest.raises(ValueError, match="not a quantity"):
        quantity("12 parsecs")


def test_the_claims_too_big_for_any_gpu_are_every_tenth_and_the_workload_is_the_same_for_a_seed() -> None:
    first, again = Workload("ns", seed=3), Workload("ns", seed=3)
    sizes = [first.next()[1] for _ in range(3 * TOO_BIG_EVERY)]
    assert sizes == [again.next()[1] for _ in range(3 * TOO_BIG_EVERY)]
    too_big = [index for index, size in enumerate(sizes) if size.too_big]
    assert too_big == [0, TOO_BIG_EVERY, 2 * TOO_BIG_EVERY]
    assert all(size.memory_gib * GIB > GPU_MEMORY for size in sizes if size.too_big)
    assert all(size.memory_gib * GIB <= GPU_MEMORY for size in sizes if not size.too_big)


AGENT = "system:serviceaccount:mpsagent-audited:agent-00"
OTHER = "system:serviceaccount:mpsagent-audited:agent-01"


def at(seconds: str) -> float:
    return datetime.fromisoformat(f"2026-12-07T10:00:{seconds}+00:00").timestamp()


def line(audit_id: str, user: str, verb: str, resource: str, received: str, stage: str = "ResponseComplete",
         done: str | None = None) -> str:  # fmt: skip
    event = {
        "auditID": audit_id,
        "stage": stage,
        "verb": verb,
        "user": {"username": user},
        "objectRef": {"resource": resource},
        "requestURI": f"/apis/x/{resource}",
        "requestReceivedTimestamp": f"2026-12-07T10:00:{received}Z",
        "stageTimestamp": f"2026-12-07T10:00:{done or received}Z",
    }
    return json.dumps(event) + "\n"


def test_each_agents_requests_in_a_window_are_counted_with_the_watches_it_holds(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    path.write_text(
        line("w1", AGENT, "watch", "resourceslices", "01.000000", "ResponseStarted")
        + line("w2", AGENT, "watch", "resourceslices", "02.000000", "ResponseStarted")
        + line("w2", AGENT, "watch", "resourceslices", "02.000000", done="12.000000")
        + line("g1", AGENT, "get", "resourceclaims", "11.000000")
        + line("p1", AGENT, "patch", "resourceslices", "15.500000")
        + line("l1", AGENT, "list", "resourceslices", "30.000000")
        + line("g2", OTHER, "get", "resourceclaims", "12.000000")
        + '{"auditID": "half a line'
    )
    log = AuditLog(path)
    counted = log.window(start=at("10.000000"), end=at("20.000000"))
    mine = counted[AGENT]
    assert (mine.writes, mine.reads, mine.watches, mine.held) == (1, 1, 0, 1)
    assert mine.by_kind == {"get resourceclaims": 1, "patch resourceslices": 1}
    assert (counted[OTHER].reads, counted[OTHER].writes) == (1, 0)
    before = log.window(start=at("00.000000"), end=at("10.000000"))[AGENT]
    assert (before.watches, before.held) == (2, 2), "w2 was open at 10:00:10"
