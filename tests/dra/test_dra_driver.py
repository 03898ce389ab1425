"""The DRA driver (`dra.driver`) over fakes of its ports: the domain's real `ClaimGrants` over two resources' real
ledgers (GPU 0 in `nvidia.com/low`, GPU 1 in `nvidia.com/high`, 80 GiB each), a fake daemon per resource
(`mpsagent_testing.mps.ceilings`: its switch takes a few of the loop's turns, it can be made to fail), a fake
API server, and real CDI spec and checkpoint files in a temporary directory. The real MPS daemon is left to
test_claim_server.

What a user would notice: a prepare that fails at any step, or that the kubelet cancels at any point, holds nothing
anywhere (the ledgers, the daemons' ceilings, the CDI specs, the checkpoint), the earlier claims untouched; one that
completed holds its claims exactly once; an unprepare gives everything back or, when its checkpoint cannot be
written, nothing."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import anyio
import pytest

from mpsagent.base.config import check_config, parse_config
from mpsagent.base.devices import ResourceName
from mpsagent.base.errors import DaemonError, HostError, KubeApiError
from mpsagent.domain.allocation import ResourceAllocator
from mpsagent.domain.claim_grants import ClaimGrants
from mpsagent.domain.claims import ClaimAllocation, ClaimDevice, ClaimRef
from mpsagent.domain.container import MemoryLimitDevice
from mpsagent.domain.plan import build_plan
from mpsagent.domain.shares import Ceilings
from mpsagent.dra import cdi, checkpoint
from mpsagent.dra.driver import ClaimDriver
from mpsagent.dra.prepared_claims import CHECKPOINT_FILE
from mpsagent.gpu.snapshot import SnapshotGpuSource
from mpsagent_testing.kubelet.cancel import cancelled_after
from mpsagent_testing.mps.ceilings import SWITCH_TURNS, FakeCeilings
from mpsagent_testing.node import small_node

GIB = 1024**3
NODE = "node-a"
LOW, HIGH = ResourceName("nvidia.com/low"), ResourceName("nvidia.com/high")
CONFIG = """version: v1
sharing:
  mps:
    resources:
    - {name: low, replicas: 4, devices: [0]}
    - {name: high, replicas: 4, devices: [1]}
"""
EARLIER = ClaimRef(namespace="ml", name="earlier", uid="0a000000-0000-4000-8000-000000000001")
CLAIM_A = ClaimRef(namespace="ml", name="train", uid="0b5f1c52-8f5e-4a55-9b0e-3f8a1c2d4e6f")
CLAIM_C = ClaimRef(namespace="ml", name="eval", uid="2d7b3e74-ab70-4c77-9d20-5bac3e4f6081")
TEST_TIMEOUT_S = 30
_T = TypeVar("_T")


@dataclass
class FakeApi:
    claims: dict[str, ClaimAllocation] = field(default_factory=dict)

    async def read_claim(self, ref: ClaimRef, *, driver: str, node: str) -> ClaimAllocation:
        await asyncio.sleep(0)
        found = self.claims.get(ref.uid)
        if found is None:
            raise KubeApiError(f"reading ResourceClaim {ref}", "resourceclaims not found", 404)
        return found

    async def claim_pods(self, ref: ClaimRef) -> tuple[str, ...] | None:
        return self.claims[ref.uid].pods if ref.uid in self.claims else None


def allocation(ref: ClaimRef, device: str, memory_gib: int) -> ClaimAllocation:
    return ClaimAllocation(
        claim=ref,
        devices=(ClaimDevice(request="gpu", pool=NODE, device=device, memory_bytes=memory_gib * GIB, compute=None),),
        pods=(f"ml/{ref.name}-0",),
    )


@dataclass(frozen=True)
class NodeState:
    """Everything a prepare or unprepare may change, as a user (or the next agent) would find it."""

    grants: dict[ResourceName, list[tuple[str, str, int]]]
    """Each ledger's live grants: claim UID, device, MiB."""
    ceilings: dict[ResourceName, Ceilings | None]
    """What each daemon holds."""
    checkpointed: list[str]
    specs: set[str]


class Node:
    def __init__(self, directory: Path) -> None:
        directory.mkdir(exist_ok=True)
        gpus = SnapshotGpuSource(small_node(directory / "node.json", memory_bytes=80 * GIB)).discover()
        plan = build_plan(check_config(parse_config(CONFIG, "config.yaml")), gpus, directory / "mps")
        self.allocators = {ResourceName(r.name): ResourceAllocator(r, plan.shm_directory) for r in plan.resources}
        self.daemons = {name: FakeCeilings(allocator) for name, allocator in self.allocators.items()}
        self.cdi_dir = directory / "cdi"
        self.checkpoint = directory / CHECKPOINT_FILE
        self.api = FakeApi()
        self.limit_devices_fail = False
        self.limit_devices_asked: list[tuple[list[MemoryLimitDevice | None], bool]] = []
        """Each call of the memory-limit devices' port: the devices, and whether any claim's file existed then."""
        self.driver = ClaimDriver(
            grants=ClaimGrants(plan, self.allocators, NODE),
            ceilings=self.daemons,
            node=NODE,
            cdi_dir=self.cdi_dir,
            checkpoint_path=self.checkpoint,
            limit_devices=self._ensure_limit_devices,
        )
        self.driver.connected(self.api)
        self.api.claims = {
            ref.uid: allocation(ref, device, gib)
            for ref, device, gib in ((EARLIER, "gpu-0", 10), (CLAIM_A, "gpu-0", 30), (CLAIM_C, "gpu-1", 20))
        }

    def _ensure_limit_devices(self, devices: Sequence[MemoryLimitDevice | None]) -> None:
        self.limit_devices_asked.append((list(devices), self.checkpoint.exists() or self.cdi_dir.exists()))
        if self.limit_devices_fail:
            raise HostError(f"cannot write the CDI spec {self.cdi_dir}/mpsagent.io-memory-limit.json: disk full")

    def state(self) -> NodeState:
        return NodeState(
            grants={
                name: sorted(
                    (g.claim.uid if g.claim else "", g.claim_device, g.share.gpus[0].memory_mib)
                    for g in allocator.ledger.live_grants()
                )
                for name, allocator in self.allocators.items()
            },
            ceilings={name: daemon.held for name, daemon in self.daemons.items()},
            checkpointed=[p.claim.uid for p in checkpoint.load(self.checkpoint)] if self.checkpoint.is_file() else [],
            specs=cdi.claim_spec_uids(self.cdi_dir) if self.cdi_dir.is_dir() else set(),
        )

    def run(self, main: Coroutine[object, object, _T]) -> _T:
        async def bounded() -> _T:
            with anyio.fail_after(TEST_TIMEOUT_S):
                return await main

        return anyio.run(bounded)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    yield Node(tmp_path)


async def prepared_earlier(node: Node) -> NodeState:
    """The earlier claim prepared (so that "as before" is not just "empty"): the node's state then."""
    (outcome,) = (await node.driver.prepare([EARLIER])).values()
    assert outcome.error == ""
    return node.state()


def completed_state(before: NodeState, node: Node) -> NodeState:
    """`before` with claims A (30 GiB of GPU 0) and C (20 GiB of GPU 1) held once each."""
    return NodeState(
        grants={
            LOW: sorted([*before.grants[LOW], (CLAIM_A.uid, "gpu-0", 30720)]),
            HIGH: sorted([*before.grants[HIGH], (CLAIM_C.uid, "gpu-1", 20480)]),
        },
        ceilings={name: allocator.ceilings() for name, allocator in node.allocators.items()},
        checkpointed=[*before.checkpointed, CLAIM_A.uid, CLAIM_C.uid],
        specs=before.specs | {CLAIM_A.uid, CLAIM_C.uid},
    )


# --- cancelled at every await ------------------------------------------------------------------------------


SWEPT_TURNS = 40
"""Turns swept one by one: past the API reads and every switch of both daemons; then the worker thread's writes take
real time, and a last call runs to its end."""


async def prepare_cancelled(node: Node, turns: int | None) -> tuple[bool, NodeState, NodeState]:
    """Whether the prepare of A and C had completed, the state before it, the state once it was cancelled; then the
    kubelet's retry, which holds each claim once whatever the cancelled call left."""
    before = await prepared_earlier(node)
    completed = await cancelled_after(node.driver.prepare([CLAIM_A, CLAIM_C]), turns=turns)
    after = node.state()
    retried = await node.driver.prepare([CLAIM_A, CLAIM_C])
    assert [o.error for o in retried.values()] == ["", ""]
    assert node.state() == completed_state(before, node), f"retried after {turns} turns"
    return completed, before, after


def test_a_prepare_cancelled_at_any_await_holds_nothing_or_its_claims_exactly_once(tmp_path: Path) -> None:
    """The kubelet gives up on NodePrepareResources after each number of the loop's turns: the API reads, the
    daemons' switches on both resources, the worker thread's writes."""
    for turns in [*range(SWEPT_TURNS), None]:
        node = Node(tmp_path / f"turns-{turns}")
        completed, before, after = node.run(prepare_cancelled(node, turns))
        if completed:
            assert turns is None or turns > 2 * SWITCH_TURNS, "every switch of both daemons a point of cancellation"
            assert after == completed_state(before, node), f"completed after {turns} turns"
        else:
            assert after == before, f"cancelled after {turns} turns"


async def unprepare_cancelled(node: Node, turns: int) -> tuple[bool, NodeState, NodeState, NodeState]:
    """Whether the unprepare of A had completed, the state before A was prepared, once it was, and once the
    unprepare was cancelled; then the kubelet's retry, which gives everything back."""
    empty = node.state()
    assert (await node.driver.prepare([CLAIM_A]))[CLAIM_A.uid].error == ""
    prepared = node.state()
    completed = await cancelled_after(node.driver.unprepare([CLAIM_A]), turns=turns)
    after = node.state()
    assert await node.driver.unprepare([CLAIM_A]) == {CLAIM_A.uid: ""}
    assert node.state() == empty
    return completed, empty, prepared, after


def test_an_unprepare_cancelled_at_any_await_gives_back_everything_or_nothing(tmp_path: Path) -> None:
    reached = []
    for turns in range(SWEPT_TURNS):
        node = Node(tmp_path / f"turns-{turns}")
        completed, empty, prepared, after = node.run(unprepare_cancelled(node, turns))
        assert after in (empty, prepared), f"cancelled after {turns} turns"
        reached.append(after == empty)
        if completed:
            break
    assert reached.count(True) > SWITCH_TURNS, "cancelled within the daemon's switch, its ceilings were restored"


# --- a prepare that fails at any step ---------------------------------------------------------------------


def _fail_limit_devices(node: Node) -> None:
    node.limit_devices_fail = True


def _fail_high_daemon(node: Node) -> None:
    node.daemons[HIGH].failing = DaemonError(f"the MPS daemon of {HIGH} is not running")


def _fail_checkpoint(node: Node) -> None:
    node.checkpoint.unlink()
    node.checkpoint.mkdir()  # a directory where the checkpoint file goes


@pytest.mark.parametrize(
    ("fail", "error"),
    [
        (_fail_limit_devices, "cannot write the CDI spec {cdi}/mpsagent.io-memory-limit.json: disk full"),
        (
            _fail_high_daemon,
            "claim ml/{name}: the MPS daemon of GPU {gpus} did not take the ceilings the claim needs (the MPS daemon "
            "of nvidia.com/high is not running); nothing was prepared: the kubelet retries",
        ),
        (_fail_checkpoint, "{checkpoint}"),
    ],
    ids=["memory-limit-spec", "one-daemon", "checkpoint"],
)
def test_a_batch_whose_daemons_checkpoint_or_limit_spec_fail_holds_nothing_of_it(
    node: Node, fail: object, error: str
) -> None:
    async def main() -> None:
        before = await prepared_earlier(node)
        fail(node)  # type: ignore[operator]
        outcomes = await node.driver.prepare([CLAIM_A, CLAIM_C])
        for ref, gpus in (
            (CLAIM_A, "GPU-00000000-aaaa-bbbb-cccc-dddddddddddd"),
            (CLAIM_C, "GPU-00000001-aaaa-bbbb-cccc-dddddddddddd"),
        ):
            expected = error.format(cdi=node.cdi_dir, name=ref.name, gpus=gpus, checkpoint=node.checkpoint)
            assert expected in outcomes[ref.uid].error
            assert outcomes[ref.uid].devices == ()
        after = node.state() if fail is not _fail_checkpoint else None
        if after is not None:
            assert after == before
        assert [p.claim for p in node.driver.prepared_claims()] == [EARLIER]
        assert node.driver.counts.refused == 2
        assert {name: node.daemons[name].held for name in (LOW, HIGH)} == before.ceilings

    node.run(main())


def test_a_claim_whose_spec_alone_fails_holds_nothing_and_the_others_of_its_batch_stand(node: Node) -> None:
    async def main() -> None:
        before = await prepared_earlier(node)
        cdi.spec_path(node.cdi_dir, CLAIM_C.uid).mkdir(parents=True)  # C's spec cannot replace a directory
        outcomes = await node.driver.prepare([CLAIM_A, CLAIM_C])
        assert outcomes[CLAIM_A.uid].error == ""
        assert str(cdi.spec_path(node.cdi_dir, CLAIM_C.uid)) in outcomes[CLAIM_C.uid].error
        after = node.state()
        assert after.grants == {LOW: sorted([*before.grants[LOW], (CLAIM_A.uid, "gpu-0", 30720)]), HIGH: []}
        assert after.ceilings == {name: a.ceilings() for name, a in node.allocators.items()}
        assert after.ceilings[HIGH] == before.ceilings[HIGH]
        assert after.checkpointed == [EARLIER.uid, CLAIM_A.uid]

    node.run(main())


def test_a_claim_the_api_server_does_not_have_is_refused_and_the_others_of_its_call_stand(node: Node) -> None:
    stray = ClaimRef(namespace="ml", name="gone", uid="9f000000-0000-4000-8000-000000000000")

    async def main() -> None:
        outcomes = await node.driver.prepare([CLAIM_A, stray])
        assert outcomes[CLAIM_A.uid].error == ""
        assert "resourceclaims not found" in outcomes[stray.uid].error
        assert node.state().checkpointed == [CLAIM_A.uid]

    node.run(main())


# --- unprepare --------------------------------------------------------------------------------------------


def test_an_unprepare_gives_back_the_share_the_ceilings_the_spec_and_the_checkpoint_entry(node: Node) -> None:
    async def main() -> None:
        before = await prepared_earlier(node)
        assert (await node.driver.prepare([CLAIM_A, CLAIM_C]))[CLAIM_C.uid].error == ""
        assert await node.driver.unprepare([CLAIM_A, CLAIM_C]) == {CLAIM_A.uid: "", CLAIM_C.uid: ""}
        assert node.state() == before
        assert node.driver.counts.unprepared == 2
        # Unknown now: unprepared again at once, as the kubelet's retry expects.
        assert await node.driver.unprepare([CLAIM_A]) == {CLAIM_A.uid: ""}

    node.run(main())


def test_an_unprepare_whose_checkpoint_cannot_be_written_leaves_the_claim_whole(node: Node) -> None:
    async def main() -> None:
        assert (await node.driver.prepare([CLAIM_A]))[CLAIM_A.uid].error == ""
        prepared = node.state()
        node.checkpoint.chmod(0o600)
        node.checkpoint.rename(node.checkpoint.with_suffix(".moved"))
        node.checkpoint.mkdir()
        answer = await node.driver.unprepare([CLAIM_A])
        assert str(node.checkpoint) in answer[CLAIM_A.uid]
        node.checkpoint.rmdir()
        node.checkpoint.with_suffix(".moved").rename(node.checkpoint)
        assert node.state() == prepared
        assert [p.claim for p in node.driver.prepared_claims()] == [CLAIM_A]

    node.run(main())


def test_the_memory_limit_devices_are_asked_for_before_anything_is_written(node: Node) -> None:
    async def main() -> None:
        assert (await node.driver.prepare([CLAIM_A]))[CLAIM_A.uid].error == ""

    node.run(main())
    assert node.limit_devices_asked == [([None], False)]
