"""One accounting per GPU across both routes: device-plugin grants and DRA claims together never hold more of a
GPU's memory, SMs or MPS clients than it has, in whatever order they come; what the slice offers the claims and
what ListAndWatch withholds follow; a refusal names the GPU, what is free and what was asked. Domain code only."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mpsagent.base.devices import MIB, GpuUuid, ReplicaId, ResourceName, format_replica_id
from mpsagent.base.errors import GrantRefusedError, RequestError
from mpsagent.base.values import TaintEffect
from mpsagent.domain.accounting import ClaimCapacity, claim_capacity
from mpsagent.domain.allocation import ResourceAllocator
from mpsagent.domain.claim_grants import ClaimGrants, LiveClaim
from mpsagent.domain.claim_shares import node_slice
from mpsagent.domain.claims import ClaimAllocation, ClaimDevice, ClaimRef
from mpsagent.domain.plan import NodePlan
from mpsagent.domain.shares import Route
from mpsagent_testing.domain import gpus_of, node_gpus, node_plan, uuid

GIB = 1024**3
NODE = "node-a"
SHM = Path("/run/nvidia/mps/shm")


def plan_of(resource: str = "{name: gpu, replicas: 4}", *, gpus: int = 2, memory_gib: int = 16) -> NodePlan:
    node = node_gpus(*gpus_of(gpus, memory_bytes=memory_gib * GIB))
    return node_plan(node, resource, mps="failRequestsGreaterThanOne: false")


def claim(name: str, gpu: int, memory_gib: float | None, compute: int | None = None) -> ClaimAllocation:
    memory = None if memory_gib is None else int(memory_gib * GIB)
    device = ClaimDevice(request="gpu", pool=NODE, device=f"gpu-{gpu}", memory_bytes=memory, compute=compute)
    ref = ClaimRef(namespace="ml", name=name, uid=f"{abs(hash(name)) % 10**8:08d}-0000-4000-8000-000000000000")
    return ClaimAllocation(claim=ref, devices=(device,))


class Node:
    def __init__(
        self,
        plan: NodePlan,
        problems: dict[GpuUuid, str] | None = None,
        unhealthy_effect: TaintEffect = TaintEffect.NO_SCHEDULE,
    ) -> None:
        self.plan = plan
        self.problems = problems if problems is not None else {}
        (resource,) = plan.resources
        self.allocator = ResourceAllocator(resource, SHM, problem=self.problems.get)
        self.claims = ClaimGrants(
            plan,
            {ResourceName(resource.name): self.allocator},
            NODE,
            problem=self.problems.get,
            unhealthy_effect=unhealthy_effect,
        )

    def ids(self, gpu: int, *indices: int) -> list[ReplicaId]:
        return [format_replica_id(uuid(gpu), i) for i in indices]


# --- the two orders, one GPU ------------------------------------------------------------------------------------


def test_a_claim_beside_device_plugin_grants_gets_only_what_they_leave() -> None:
    """2 of 4 replicas of a 16 GiB GPU held by the device plugin: the slice offers 8 GiB and 50 % of its SMs; a
    whole-GPU claim, and one of 10 GiB, are refused naming the GPU, what is free and what was asked; 8 GiB fits."""
    node = Node(plan_of())
    node.allocator.allocate([node.ids(0, 0, 1)])
    shares, tally = node.allocator.resource.shares, node.allocator.ledger.tally
    assert claim_capacity(shares, tally, 0) == ClaimCapacity(memory_mib=8192, compute=50, clients=47)
    for refused, asked in ((claim("whole", 0, None), "16384 MiB"), (claim("ten", 0, 10), "10240 MiB")):
        with pytest.raises(GrantRefusedError) as error:
            node.claims.prepare(refused, now=0)
        assert error.value.kind == "memory" and error.value.gpu == uuid(0)
        assert str(error.value) == (
            f"claim ml/{refused.claim.name}: GPU {uuid(0)} has 8192 MiB of its 16384 MiB free (device-plugin grants "
            f"hold 8192 MiB and 50 % of its SMs, claims 0 MiB and 0 %); {asked} were asked; nothing was prepared: "
            "the kubelet retries, and the claim is prepared once the grants and claims on the GPU leave room for it "
            "(the device offered more when the scheduler allocated it: a device-plugin grant or a claim came first)"
        )
    assert tally.held(0, Route.CLAIM) == (0, 0)  # a refusal holds nothing
    node.claims.prepare(claim("eight", 0, 8), now=0)
    assert tally.held(0) == (16384, 50)


def test_device_plugin_grants_beside_claims_get_only_what_they_leave_and_the_rest_is_withheld() -> None:
    """A 10 GiB claim on a 16 GiB GPU of 4 replicas (4 GiB each): one replica fits beside it; the other three free
    ones are withheld from ListAndWatch, and an Allocate of two is refused whole."""
    node = Node(plan_of())
    node.claims.prepare(claim("ten", 0, 10), now=0)
    (withheld,) = node.allocator.withheld()
    assert (withheld.uuid, withheld.replica_ids) == (uuid(0), tuple(node.ids(0, 1, 2, 3)))
    assert withheld.reason == (
        "6144 MiB and 100 % of its SMs are free (device-plugin grants hold 0 MiB and 0 % of its SMs, claims 10240 MiB "
        "and 0 %); one ID needs 4096 MiB and 25 %"
    )
    with pytest.raises(GrantRefusedError) as error:
        node.allocator.allocate([node.ids(0, 0, 1)])
    assert str(error.value).startswith(
        f"nvidia.com/gpu: GPU {uuid(0)} has 6144 MiB of its 16384 MiB free (device-plugin grants hold 0 MiB and 0 % "
        "of its SMs, claims 10240 MiB and 0 %); 8192 MiB were asked; nothing was granted "
        f"(asked: '{node.ids(0, 0)[0]}', '{node.ids(0, 1)[0]}')"
    )
    node.allocator.allocate([node.ids(0, 0)])
    assert node.allocator.withheld()[0].replica_ids == tuple(node.ids(0, 1, 2, 3))  # 2048 MiB left: none fits


def test_compute_counts_claims_that_ask_it_and_replicas() -> None:
    node = Node(plan_of())
    node.claims.prepare(claim("seventy", 0, 1, compute=70), now=0)
    assert node.allocator.allocate([node.ids(0, 0)])  # 25 % fits beside 70 %
    with pytest.raises(GrantRefusedError, match="has 5 % of its SMs free"):
        node.allocator.allocate([node.ids(0, 1)])
    node.claims.prepare(claim("memory-only", 0, 1), now=0)  # a claim that asks no compute holds none


def test_an_unhealthy_gpu_takes_no_new_grant_or_claim_but_keeps_a_container_it_had() -> None:
    problems: dict[GpuUuid, str] = {}
    node = Node(plan_of(), problems)
    node.allocator.allocate([node.ids(0, 0)])
    problems[uuid(0)] = "critical Xid 79"
    with pytest.raises(GrantRefusedError) as error:
        node.claims.prepare(claim("on-bad", 0, 1), now=0)
    assert error.value.kind == "unhealthy"
    assert f"GPU {uuid(0)} is unhealthy (critical Xid 79)" in str(error.value)
    assert "once the GPU is healthy again (its device is tainted: new claims go elsewhere)" in str(error.value)
    with pytest.raises(GrantRefusedError, match="is unhealthy"):
        node.allocator.allocate([node.ids(0, 1)])
    node.allocator.allocate([node.ids(0, 0)])  # the same IDs again (a container restart): nothing more is asked
    (device,) = [d for uuid_, d in node.claims.room(now=5.0).items() if uuid_ == uuid(0)]
    assert [(t.key, t.value, t.effect, t.added) for t in device.taints] == [
        ("mps.mpsagent.io/unhealthy", "critical-Xid-79", "NoSchedule", 5.0)
    ]
    assert node.claims.room(now=9.0)[uuid(0)].taints[0].added == 5.0  # since it became unhealthy
    del problems[uuid(0)]
    assert node.claims.room(now=10.0)[uuid(0)].taints == ()


def test_the_noexecute_opt_in_is_the_failed_gpus_taint_and_never_a_full_gpus() -> None:
    """--dra-taint-effect NoExecute evicts the claims' pods from a failed GPU; a GPU the device-plugin grants fill
    only keeps new claims off, whatever the setting: the claims on it are within it."""
    problems = {uuid(0): "critical Xid 79"}
    node = Node(plan_of(), problems, unhealthy_effect=TaintEffect.NO_EXECUTE)
    node.allocator.allocate([node.ids(1, *range(4))])  # GPU 1's 4 replicas: all of its memory
    room = node.claims.room(now=0)
    assert [(t.key, t.effect) for t in room[uuid(0)].taints] == [("mps.mpsagent.io/unhealthy", "NoExecute")]
    assert [(t.key, t.effect) for t in room[uuid(1)].taints] == [("mps.mpsagent.io/no-memory-left", "NoSchedule")]


def test_the_client_limit_counts_both_routes_with_one_wording() -> None:
    node = Node(plan_of("{name: gpu-mem, memoryUnit: 256Mi}", gpus=1))
    for i in range(47):
        node.allocator.allocate([node.ids(0, i)])
    node.claims.prepare(claim("forty-eight", 0, 0.25), now=0)
    with pytest.raises(GrantRefusedError) as error:
        node.claims.prepare(claim("forty-nine", 0, 0.25), now=0)
    assert error.value.kind == "clients"
    assert f"GPU {uuid(0)} would hold 49 MPS clients (device-plugin grants and claims), but MPS serves at most 48" in (
        str(error.value)
    )


def test_the_slice_offers_the_claims_the_mps_clients_the_grants_leave_and_taints_a_gpu_they_fill() -> None:
    """Without it the scheduler allocated a 49th client that the agent then refused at prepare. None left: the
    capacity has no request policy (a request then consumes nothing), so the device is tainted NoSchedule."""
    node = Node(plan_of("{name: gpu-mem, memoryUnit: 256Mi}", gpus=1))
    for i in range(47):
        node.allocator.allocate([node.ids(0, i)])
    room = node.claims.room(now=0)[uuid(0)]
    assert (room.capacity.clients, room.taints) == (1, ())
    node.allocator.allocate([node.ids(0, 47)])
    room = node.claims.room(now=3.0)[uuid(0)]
    assert room.capacity.clients == 0
    assert [(t.key, t.value, t.effect, t.added) for t in room.taints] == [
        ("mps.mpsagent.io/no-clients-left", "device-plugin-grants", "NoSchedule", 3.0)
    ]
    (device,) = node_slice(node.plan, "node-1", node.claims.room(now=4.0)).devices
    assert not device.clients.has_policy and device.clients.value == 0


# --- any order, both routes -------------------------------------------------------------------------------------


class BothRoutes(RuleBasedStateMachine):
    """Device-plugin Allocates (any IDs, as a kubelet that granted some of them before would send), their release,
    claims of any memory and compute, their unprepare, and GPU failures, in any order: no GPU is ever held beyond
    its memory, its SMs or MPS's client limit, and what is offered to each route fits."""

    def __init__(self) -> None:
        super().__init__()
        self.problems: dict[GpuUuid, str] = {}
        self.node = Node(plan_of(gpus=2, memory_gib=16), self.problems)
        self.claims: list[LiveClaim] = []
        self.names = 0

    @rule(gpu=st.integers(0, 1), indices=st.sets(st.integers(0, 3), min_size=1, max_size=4))
    def allocate(self, gpu: int, indices: set[int]) -> None:
        with contextlib.suppress(GrantRefusedError):
            self.node.allocator.allocate([self.node.ids(gpu, *sorted(indices))])

    @precondition(lambda self: self.node.allocator.ledger.listed_route())
    @rule(data=st.data())
    def release_grant(self, data: st.DataObject) -> None:
        grant = data.draw(st.sampled_from(self.node.allocator.ledger.listed_route()))
        self.node.allocator.ledger.release([grant.grant_id])

    @rule(
        gpu=st.integers(0, 1),
        memory=st.sampled_from([None, 0.5, 1, 4, 7.5, 8, 12, 16]),
        compute=st.sampled_from([None, 0, 10, 30, 60, 100]),
    )
    def prepare(self, gpu: int, memory: float | None, compute: int | None) -> None:
        self.names += 1
        with contextlib.suppress(RequestError):
            self.claims.append(self.node.claims.prepare(claim(f"c{self.names}", gpu, memory, compute), now=0))

    @precondition(lambda self: self.claims)
    @rule(data=st.data())
    def unprepare(self, data: st.DataObject) -> None:
        claim = data.draw(st.sampled_from(self.claims))
        self.claims.remove(claim)
        self.node.claims.release(claim)

    @rule(gpu=st.integers(0, 1), failed=st.booleans())
    def health(self, gpu: int, failed: bool) -> None:
        if failed:
            self.problems[uuid(gpu)] = "critical Xid 79"
        else:
            self.problems.pop(uuid(gpu), None)

    @invariant()
    def no_gpu_is_held_beyond_what_it_has(self) -> None:
        allocator = self.node.allocator
        shares, tally = allocator.resource.shares, allocator.ledger.tally
        for gpu in shares.gpus:
            memory, compute = tally.held(gpu.ordinal)
            assert memory <= gpu.memory_mib, (gpu.uuid, memory)
            assert compute <= 100, (gpu.uuid, compute)
            assert tally.clients(gpu.ordinal) <= gpu.max_clients
            offered = claim_capacity(shares, tally, gpu.ordinal)
            claims_memory, claims_compute = tally.held(gpu.ordinal, Route.CLAIM)
            assert claims_memory <= offered.memory_mib and claims_compute <= offered.compute
            assert tally.clients(gpu.ordinal, Route.CLAIM) <= offered.clients

    @invariant()
    def the_replicas_offered_fit(self) -> None:
        allocator = self.node.allocator
        shares, tally = allocator.resource.shares, allocator.ledger.tally
        withheld = {held.uuid: len(held.replica_ids) for held in allocator.withheld()}
        for gpu in shares.gpus:
            free = [
                r
                for r in allocator.resource.device_ids
                if r.startswith(gpu.uuid) and allocator.ledger.holder(r) is None
            ]
            offered = len(free) - withheld.get(gpu.uuid, 0)
            memory, compute = tally.held(gpu.ordinal)
            assert memory + offered * (gpu.memory_bytes // 4 // MIB) <= gpu.memory_mib
            assert compute + offered * 25 <= 100


BothRoutes.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
test_no_gpu_is_oversubscribed_in_any_order = BothRoutes.TestCase
