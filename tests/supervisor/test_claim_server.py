"""The DRA claim server (`supervisor.claim_server`) over real resource servers: the real MPS control daemon (started
by the resource's DaemonSupervisor, quit by the test), a node snapshot of two 80 GiB GPUs, a temporary MPS root and
CDI spec directory; only the API server is a test double (`FakeKubeApi`, the claims' allocations by UID).

What a user sees: a prepared claim's devices, its CDI spec's environment, its share in the resource's ledger and the
daemon's ceilings read back from the daemon; retries that hold nothing twice; an unprepare that gives everything
back; a prepare that fails at the daemon or the CDI directory, or is cancelled, holding nothing (the order of every
step, each failure and cancellation at every await: test_dra_driver, over fakes of the driver's ports); MPS's
client limit counting device-plugin grants and claims alike; an agent restart that holds the checkpointed claims
again; and `--status`'s view of it all."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import anyio
import msgspec
import pytest
import structlog
from lightkube.resources.resource_v1 import ResourceClaim

from mpsagent.base.config import resolve_settings
from mpsagent.base.devices import MIB, Health
from mpsagent.base.errors import HostError, KubeApiError
from mpsagent.documents.status import render_status_text, status_document
from mpsagent.documents.status_document import PodResourcesStatus
from mpsagent.domain.claims import DRA_DRIVER, ClaimAllocation, ClaimDevice, ClaimRef, OpaqueConfig, PreparedClaim
from mpsagent.domain.grant_kind import GrantKind
from mpsagent.domain.ledger import Grant
from mpsagent.domain.plan import NodePlan, build_plan
from mpsagent.domain.shares import Ceilings
from mpsagent.dra import cdi, checkpoint
from mpsagent.dra.claim_object import claim_allocation
from mpsagent.dra.node_service import PrepareOutcome
from mpsagent.dra.prepared_claims import CHECKPOINT_FILE, live_claims_without_dra
from mpsagent.gpu.snapshot import SnapshotGpuSource
from mpsagent.kubelet.cdi_spec import CdiDevice
from mpsagent.mps.paths import prepare_directories
from mpsagent.supervisor.claim_server import ClaimServer
from mpsagent.supervisor.resource_server import ResourceServer
from mpsagent_testing.domain import claims_held
from mpsagent_testing.kubelet.cancel import cancelled_after
from mpsagent_testing.mps.daemon import REAL_BIN, control, require_real_control, restored_after
from mpsagent_testing.node import GPU0, GPU1, RESOURCE, config, small_node, write_config
from mpsagent_testing.processes import alive, processes_using
from mpsagent_testing.waiting import wait_for

require_real_control()  # each test runs the real MPS control daemon

GIB = 1024**3
NODE = "node-a"
TEST_TIMEOUT_S = 60
"""A whole test's async part: daemons start and quit in well under a second each."""
DAEMON_GONE_S = 10

UID_A = "0b5f1c52-8f5e-4a55-9b0e-3f8a1c2d4e6f"
UID_B = "1c6a2d63-9a6f-4b66-8c1f-4a9b2d3e5f70"
UID_C = "2d7b3e74-ab70-4c77-9d20-5bac3e4f6081"
STRAY_UID = "9f000000-0000-4000-8000-000000000000"
CLAIM_A = ClaimRef(namespace="ml", name="train", uid=UID_A)
CLAIM_B = ClaimRef(namespace="ml", name="serve", uid=UID_B)
CLAIM_C = ClaimRef(namespace="ml", name="eval", uid=UID_C)

WHOLE = ("100.0", "80G", "80G")
"""The daemon's defaults with no live share: thread percentage, pinned memory of ordinals 0 and 1."""
THIRTY_GIB_ON_GPU0 = ("37.0", "30G", "80G")
"""With a 30 GiB share of GPU 0 (threads in proportion: 100 * 30720 // 81920)."""


def allocation(
    ref: ClaimRef,
    *,
    device: str = "gpu-0",
    memory_bytes: int | None = 30 * GIB,
    compute: int | None = None,
    pool: str = NODE,
    configs: tuple[OpaqueConfig, ...] = (),
    pods: tuple[str, ...] = ("ml/trainer-0",),
) -> ClaimAllocation:
    """What the API server says the scheduler allocated `ref`: one device of this driver."""
    return ClaimAllocation(
        claim=ref,
        devices=(ClaimDevice(request="gpu", pool=pool, device=device, memory_bytes=memory_bytes, compute=compute),),
        configs=configs,
        pods=pods,
    )


def claim_object(ref: ClaimRef, consumed: dict[str, str]) -> ResourceClaim:
    """The ResourceClaim `ref` as the API server returns it: one request `gpu`, allocated gpu-0 of the node with
    `consumed`."""
    result = {"request": "gpu", "driver": DRA_DRIVER, "pool": NODE, "device": "gpu-0", "consumedCapacity": consumed}
    document = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": ref.name, "namespace": ref.namespace, "uid": ref.uid},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRA_DRIVER}}]}},
        "status": {"allocation": {"devices": {"results": [result]}}},
    }
    return cast(ResourceClaim, ResourceClaim.from_dict(document))


@dataclass
class FakeKubeApi:
    """The API server, as far as the claim server asks it: each claim's allocation, by UID; or the claim itself
    (`objects`), turned into its allocation as the real client does."""

    claims: dict[str, ClaimAllocation] = field(default_factory=dict)
    objects: dict[str, ResourceClaim] = field(default_factory=dict)
    reads: list[ClaimRef] = field(default_factory=list)
    reading: int = 0
    most_at_once: int = 0

    def allocate(self, *allocations: ClaimAllocation) -> None:
        for each in allocations:
            self.claims[each.claim.uid] = each

    async def read_claim(self, ref: ClaimRef, *, driver: str, node: str) -> ClaimAllocation:
        self.reads.append(ref)
        assert (driver, node) == (DRA_DRIVER, NODE)
        self.reading += 1
        self.most_at_once = max(self.most_at_once, self.reading)
        await anyio.sleep(0.01)  # a real read awaits the server: another prepare (or read) may run meanwhile
        self.reading -= 1
        if ref.uid in self.objects:
            return claim_allocation(self.objects[ref.uid], ref, driver=driver, node=node)
        found = self.claims.get(ref.uid)
        if found is None:
            raise KubeApiError(f"reading ResourceClaim {ref}", "resourceclaims not found", 404)
        return found


@dataclass
class Agent:
    """What one start of the agent builds: the resource's server, and the claim server over it."""

    claims: ClaimServer
    resource: ResourceServer
    pids: list[int]

    @property
    def pipe(self) -> Path:
        return self.resource.plan.pipe_directory

    def ceilings(self) -> tuple[str, str, str]:
        """The daemon's defaults, read from the real daemon: thread percentage, pinned memory of ordinals 0, 1."""
        return (
            control(self.pipe, "get_default_active_thread_percentage"),
            control(self.pipe, "get_default_device_pinned_mem_limit 0"),
            control(self.pipe, "get_default_device_pinned_mem_limit 1"),
        )

    def claim_grants(self) -> list[tuple[str, str, int, int]]:
        """The ledger's live claim shares: (claim UID, device, memory MiB, thread percentage)."""
        return [_described(g) for g in claims_held(self.resource.allocator.ledger)]

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """The resource's MPS daemon up (at the ledger's ceilings, as the agent starts it once the kubelet's listing
        is known) for the block; quit when it ends."""
        self.resource.grants_known()
        async with anyio.create_task_group() as tg:
            await tg.start(self.resource.daemon.run)
            await tg.start(self.claims.follow)
            pid = self.resource.daemon.status().pid
            assert pid is not None
            self.pids.append(pid)
            try:
                yield
            finally:
                tg.cancel_scope.cancel()


def _described(grant: Grant) -> tuple[str, str, int, int]:
    assert grant.claim is not None
    return (grant.claim.uid, grant.claim_device, grant.share.gpus[0].memory_mib, grant.share.thread_percentage)


class Node:
    """The node the tests run on: two 80 GiB GPUs in resource `nvidia.com/gpu` (48 replicas each), the MPS root
    and CDI directory under a short temporary directory, and the API server's double."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        snapshot = small_node(directory / "node.json", memory_bytes=80 * GIB)
        config_file = write_config(directory / "config.yaml", config(replicas=48))
        self.mps_root = directory / "mps"
        self.cdi_dir = directory / "cdi"
        self.checkpoint = self.mps_root / CHECKPOINT_FILE
        self.settings = resolve_settings(
            {
                "config_file": str(config_file),
                "mps_root": str(self.mps_root),
                "mps_control_bin": str(REAL_BIN),
                "mps_on_exit": "quit",
                "probe_interval_seconds": "60",  # no probe round in a test: only its own calls read the daemon
                "kubelet_socket": str(directory / "kubelet" / "device-plugins" / "kubelet.sock"),
            },
            environ={},
        )
        self.gpu_source = SnapshotGpuSource(snapshot)
        self.plan: NodePlan = build_plan(self.settings.sharing, self.gpu_source.discover(), self.mps_root)
        prepare_directories(self.plan)
        self.api = FakeKubeApi()
        self.pids: list[int] = []

    def agent(self) -> Agent:
        """A fresh agent's objects over the same MPS root and CDI directory (an agent restart builds these)."""
        resource = ResourceServer(
            plan=self.plan.resources[0],
            shm_directory=self.plan.shm_directory,
            settings=self.settings,
            gpu_source=self.gpu_source,
            rpc_timer=None,
            reconcile_soon=lambda: None,
        )
        claims = ClaimServer(
            plan=self.plan,
            resources=[resource],
            node=NODE,
            kubelet_dir=self.directory / "kubelet",
            cdi_dir=self.cdi_dir,
            kubeconfig=None,
            api=self.api,  # type: ignore[arg-type]  # the test double has the methods ClaimServer calls
        )
        return Agent(claims=claims, resource=resource, pids=self.pids)

    def run(self, main: Callable[[], Awaitable[None]]) -> None:
        async def bounded() -> None:
            with anyio.fail_after(TEST_TIMEOUT_S):
                await main()

        try:
            anyio.run(bounded)
        except BaseExceptionGroup as group:  # a failure inside a daemon's block: shown as itself
            failure: BaseException = group
            while isinstance(failure, BaseExceptionGroup) and len(failure.exceptions) == 1:
                failure = failure.exceptions[0]
            raise failure from None

    def checkpointed(self) -> list[str]:
        """The UIDs the checkpoint lists."""
        return [prepared.claim.uid for prepared in checkpoint.load(self.checkpoint)]

    def spec_uids(self) -> set[str]:
        return cdi.claim_spec_uids(self.cdi_dir) if self.cdi_dir.is_dir() else set()

    def spec_env(self, uid: str) -> dict[str, str]:
        """The environment of the claim's one CDI device, from its spec file."""
        spec = json.loads(cdi.spec_path(self.cdi_dir, uid).read_text())
        (device,) = spec["devices"]
        return dict(item.split("=", 1) for item in device["containerEdits"]["env"])


@pytest.fixture
def node(short_dir: Path) -> Iterator[Node]:
    made = Node(short_dir)
    yield made
    # Every daemon a test started was quit when its block ended (short_dir's fixture kills any left, too late).
    for pid in made.pids:
        wait_for(lambda pid=pid: not alive(pid), DAEMON_GONE_S, f"MPS daemon {pid} to end")
    assert processes_using(short_dir) == []


async def prepare_one(agent: Agent, ref: ClaimRef) -> PrepareOutcome:
    return (await agent.claims.driver.prepare([ref]))[ref.uid]


async def eventually(condition: Callable[[], object], what: str) -> None:
    """Wait, bounded, for the claim server's follow task (it looks at once after a prepare or unprepare)."""
    with anyio.fail_after(5):
        while not condition():
            await anyio.sleep(0.01)
    assert condition(), what


def counters(agent: Agent) -> tuple[int, int, int]:
    status = agent.claims.status()
    return (status.prepared, status.refused, status.unprepared)


# --- prepare, and the kubelet's retries ------------------------------------------------------------------


def test_a_prepared_claim_gets_its_devices_cdi_spec_ledger_share_and_daemon_ceilings(node: Node) -> None:
    agent = node.agent()

    async def main() -> None:
        async with agent.running():
            assert agent.ceilings() == WHOLE
            node.api.allocate(allocation(CLAIM_A))
            outcome = await prepare_one(agent, CLAIM_A)

            assert outcome.error == ""
            (device,) = outcome.devices
            assert device.cdi_device_ids == (f"mpsagent.io/mps-share={UID_A}-gpu-0",)
            assert (device.request, device.pool, device.device, device.gpu, device.resource) == (
                "gpu",
                NODE,
                "gpu-0",
                GPU0,
                RESOURCE,
            )
            assert (device.memory_mib, device.thread_percentage, device.kind) == (30720, 37, GrantKind.CAPPED)

            env = node.spec_env(UID_A)
            assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=30720M"
            assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "37"
            assert env["NVIDIA_VISIBLE_DEVICES"] == GPU0
            assert env["CUDA_MPS_PIPE_DIRECTORY"]
            assert oct(cdi.spec_path(node.cdi_dir, UID_A).stat().st_mode & 0o777) == "0o644"

            assert agent.claim_grants() == [(UID_A, "gpu-0", 30720, 37)]
            assert agent.resource.allocator.ceilings() == Ceilings(thread_percentage=37, memory_mib=(30720, 81920))
            assert agent.ceilings() == THIRTY_GIB_ON_GPU0
            assert node.checkpointed() == [UID_A]
            assert counters(agent) == (1, 0, 0)

            # The kubelet retries (its answer was lost): the same devices, nothing held twice, nothing counted.
            grants_before = claims_held(agent.resource.allocator.ledger)
            again = await prepare_one(agent, CLAIM_A)
            assert again == PrepareOutcome(devices=outcome.devices)
            assert claims_held(agent.resource.allocator.ledger) == grants_before
            assert agent.resource.allocator.ledger.tally.clients(0) == 1
            assert agent.ceilings() == THIRTY_GIB_ON_GPU0
            assert node.checkpointed() == [UID_A]
            assert node.spec_uids() == {UID_A}
            assert counters(agent) == (1, 0, 0)

    node.run(main)


def test_two_prepares_of_one_claim_at_once_hold_it_once(node: Node) -> None:
    agent = node.agent()

    async def main() -> None:
        async with agent.running():
            node.api.allocate(allocation(CLAIM_A))
            outcomes: list[PrepareOutcome] = []

            async def prepare() -> None:
                outcomes.append(await prepare_one(agent, CLAIM_A))

            async with anyio.create_task_group() as tg:
                tg.start_soon(prepare)
                tg.start_soon(prepare)
            assert len(node.api.reads) == 2  # both read the claim before either held it
            first, second = outcomes
            assert first.error == second.error == ""
            assert first.devices == second.devices
            assert agent.claim_grants() == [(UID_A, "gpu-0", 30720, 37)]
            assert agent.ceilings() == THIRTY_GIB_ON_GPU0
            assert node.checkpointed() == [UID_A]

    node.run(main)


def test_two_requests_of_one_claim_on_one_gpu_get_cdi_devices_of_their_own(node: Node) -> None:
    """The slice's devices allow multiple allocations, so the scheduler may give two requests of one claim the same
    GPU (each its own share ID). Each request's container is given its own CDI device, with its own caps; a spec that
    names one device twice is refused whole by the container runtime ("invalid spec, multiple device")."""
    agent = node.agent()
    outcomes: dict[str, PrepareOutcome] = {}

    async def main() -> None:
        async with agent.running():
            node.api.allocate(
                ClaimAllocation(
                    claim=CLAIM_A,
                    devices=(
                        ClaimDevice(request="small", pool=NODE, device="gpu-0", share_id="a1", memory_bytes=10 * GIB),
                        ClaimDevice(request="large", pool=NODE, device="gpu-0", share_id="b2", memory_bytes=20 * GIB),
                    ),
                )
            )
            outcomes.update(await agent.claims.driver.prepare([CLAIM_A]))
            assert sorted(agent.claim_grants()) == [(UID_A, "gpu-0", 10240, 12), (UID_A, "gpu-0", 20480, 25)]
            assert agent.ceilings() == ("25.0", "20G", "80G")

    node.run(main)
    outcome = outcomes[UID_A]
    assert outcome.error == ""
    assert [(d.request, d.share_id, d.memory_mib) for d in outcome.devices] == [
        ("small", "a1", 10240),
        ("large", "b2", 20480),
    ]
    spec = json.loads(cdi.spec_path(node.cdi_dir, UID_A).read_text())
    names = [device["name"] for device in spec["devices"]]
    assert len(set(names)) == 2, f"the CDI spec names one device twice: {names}"
    ids = [d.cdi_device_ids[0] for d in outcome.devices]
    assert ids == [cdi.cdi_device_id(name) for name in names]


# --- a claim's ceiling changed behind the agent ------------------------------------------------------------


@pytest.mark.parametrize("moved", ["8292M", "8092M"])
def test_a_claims_ceiling_moved_by_100_mib_is_restored_within_a_second_and_counted(node: Node, moved: str) -> None:
    """An 8Gi claim's ceiling is 8192M, which reads back `8G` as 8092M and 8292M do: only the daemon's log shows
    the change, and the agent restores the claim's exact figure."""
    agent = node.agent()
    log = node.plan.resources[0].log_directory / "control.log"
    changed, restore = f"set_default_device_pinned_mem_limit 0 {moved}", "set_default_device_pinned_mem_limit 0 8192M"

    async def main() -> None:
        async with agent.running():
            node.api.allocate(allocation(CLAIM_A, memory_bytes=8 * GIB))
            assert (await prepare_one(agent, CLAIM_A)).error == ""
            assert agent.ceilings()[1] == "8G"
            await anyio.to_thread.run_sync(control, agent.pipe, changed)  # a root tenant, through its pipe
            with anyio.fail_after(5):
                while (took := restored_after(log, changed, restore)) is None:
                    await anyio.sleep(0.05)
            assert took <= 1.0
            status = agent.resource.daemon.status()
            assert (status.cap_tamper, status.cap_tamper_in_log) == (1, 1)
            assert status.last_cap_tamper is not None
            assert status.last_cap_tamper.found == (
                f"`{changed}` set the default pinned memory limit of ordinal 0 to {moved[:-1]} MiB; the ledger wants "
                "8192 MiB"
            )

    node.run(main)


# --- unprepare -------------------------------------------------------------------------------------------


def test_unprepare_gives_back_the_share_the_ceilings_the_spec_and_the_checkpoint_entry(node: Node) -> None:
    agent = node.agent()

    async def main() -> None:
        async with agent.running():
            node.api.allocate(allocation(CLAIM_A), allocation(CLAIM_B, device="gpu-1", memory_bytes=20 * GIB))
            outcomes = await agent.claims.driver.prepare([CLAIM_A, CLAIM_B])
            assert [o.error for o in outcomes.values()] == ["", ""]
            assert agent.ceilings() == ("37.0", "30G", "20G")

            assert await agent.claims.driver.unprepare([CLAIM_A]) == {UID_A: ""}
            assert agent.claim_grants() == [(UID_B, "gpu-1", 20480, 25)]
            assert agent.ceilings() == ("25.0", "80G", "20G")
            assert not cdi.spec_path(node.cdi_dir, UID_A).exists()
            assert node.spec_uids() == {UID_B}
            assert node.checkpointed() == [UID_B]
            assert counters(agent) == (2, 0, 1)

            assert await agent.claims.driver.unprepare([CLAIM_B]) == {UID_B: ""}
            assert agent.claim_grants() == []
            assert agent.ceilings() == WHOLE
            assert node.spec_uids() == set()
            assert node.checkpointed() == []

            # Again (the kubelet retries), and a claim never prepared: answered at once, nothing changes.
            version = agent.resource.allocator.ledger.version
            saved = node.checkpoint.read_bytes()
            unknown = ClaimRef(namespace="ml", name="never", uid=UID_C)
            assert await agent.claims.driver.unprepare([CLAIM_A, unknown]) == {UID_A: "", UID_C: ""}
            assert agent.resource.allocator.ledger.version == version
            assert node.checkpoint.read_bytes() == saved
            assert agent.ceilings() == WHOLE
            assert counters(agent) == (2, 0, 2)

    node.run(main)


# --- a prepare that fails holds nothing ------------------------------------------------------------------


def test_a_prepare_whose_cdi_spec_cannot_be_written_holds_nothing(node: Node) -> None:
    agent = node.agent()
    node.cdi_dir.write_text("a regular file where the CDI directory should be\n")

    async def main() -> None:
        async with agent.running():
            node.api.allocate(allocation(CLAIM_A))
            outcome = await prepare_one(agent, CLAIM_A)

            assert outcome.devices == ()
            assert str(cdi.spec_path(node.cdi_dir, UID_A)) in outcome.error
            assert agent.claim_grants() == []
            assert agent.resource.allocator.ledger.tally.clients(0) == 0
            assert agent.ceilings() == WHOLE
            assert not node.checkpoint.exists() or node.checkpointed() == []
            assert agent.claims.status().claims == ()
            assert counters(agent) == (0, 1, 0)

            # The directory is there again: the kubelet's retry prepares the claim.
            node.cdi_dir.unlink()
            retried = await prepare_one(agent, CLAIM_A)
            assert retried.error == ""
            assert agent.claim_grants() == [(UID_A, "gpu-0", 30720, 37)]
            assert agent.ceilings() == THIRTY_GIB_ON_GPU0
            assert counters(agent) == (1, 1, 0)

    node.run(main)


def test_the_error_of_a_cdi_spec_that_cannot_be_written_says_so(node: Node) -> None:
    """The spec's write fails; the undo then cannot remove the spec either (the same missing directory): the
    kubelet must be told what failed, the write, not the clean-up's failure in its place."""
    agent = node.agent()
    node.cdi_dir.write_text("a regular file where the CDI directory should be\n")

    outcomes: list[PrepareOutcome] = []

    async def main() -> None:
        async with agent.running():
            node.api.allocate(allocation(CLAIM_A))
            outcomes.append(await prepare_one(agent, CLAIM_A))

    node.run(main)
    (outcome,) = outcomes
    assert outcome.error.startswith(f"cannot write the CDI spec {cdi.spec_path(node.cdi_dir, UID_A)}: ")


def test_a_prepare_while_the_daemon_is_down_holds_nothing(node: Node) -> None:
    agent = node.agent()  # its daemon never started

    async def main() -> None:
        node.api.allocate(allocation(CLAIM_A))
        outcome = await prepare_one(agent, CLAIM_A)
        assert outcome.devices == ()
        assert outcome.error == (
            f"claim ml/train: GPU {GPU0} is unhealthy (its MPS daemon is not up); nothing was prepared: the kubelet "
            "retries, and the claim is prepared once the GPU is healthy again (its device is tainted: new claims go "
            "elsewhere)"
        )
        # A daemon that is down before its resource knows it: the ceilings cannot be held, and nothing is.
        agent.resource.inventory.set_resource_problem("mps daemon", False)
        outcome = await prepare_one(agent, CLAIM_A)
        assert outcome.error == (
            f"claim ml/train: the MPS daemon of GPU {GPU0} did not take the ceilings the claim needs (the MPS daemon "
            f"of {RESOURCE} is not running); nothing was prepared: the kubelet retries"
        )
        assert agent.claim_grants() == []
        assert agent.resource.allocator.ceilings() == Ceilings(thread_percentage=100, memory_mib=(81920, 81920))
        assert node.spec_uids() == set()
        assert node.checkpointed() == []
        assert counters(agent) == (0, 2, 0)

    node.run(main)


@pytest.mark.parametrize(
    ("refused", "message"),
    [
        (
            allocation(CLAIM_A, pool="node-b"),
            "claim ml/train: device `gpu-0` of pool `node-b` is not one this node publishes (pool node-a: gpu-0, "
            "gpu-1); the ResourceSlice it was allocated from is out of date",
        ),
        (
            allocation(CLAIM_A, device="gpu-7"),
            "claim ml/train: device `gpu-7` of pool `node-a` is not one this node publishes",
        ),
        (
            allocation(
                CLAIM_A,
                configs=(
                    OpaqueConfig(
                        requests=(),
                        parameters=b'{"apiVersion": "mps.mpsagent.io/v1alpha1", "kind": "MpsShareConfig", '
                        b'"clientPriority": 7}',
                        source="claim",
                    ),
                ),
            ),
            "clientPriority must be 0 (normal) or 1 (below normal), not 7",
        ),
        (
            allocation(CLAIM_A, configs=(OpaqueConfig(requests=(), parameters=b"{not json", source="class"),)),
            "claim ml/train: the opaque parameters from the class are not JSON",
        ),
        (allocation(CLAIM_A, memory_bytes=81 * GIB), "was allocated 86973087744 bytes of memory"),
    ],
    ids=["other-pool", "unknown-device", "bad-priority", "parameters-not-json", "more-memory-than-the-gpu"],
)
def test_a_claim_the_domain_refuses_holds_nothing(node: Node, refused: ClaimAllocation, message: str) -> None:
    agent = node.agent()

    async def main() -> None:
        async with agent.running():
            node.api.allocate(refused)
            outcome = await prepare_one(agent, CLAIM_A)
            assert outcome.devices == ()
            assert message in outcome.error
            assert agent.claim_grants() == []
            assert agent.ceilings() == WHOLE
            assert node.spec_uids() == set()
            assert not node.checkpoint.exists()
            assert counters(agent) == (0, 1, 0)

    node.run(main)


def test_a_claim_consuming_a_capacity_the_devices_do_not_have_is_refused_naming_it_and_holds_nothing(
    node: Node,
) -> None:
    """Issue 37: `bogus: 5` in a claim's allocation was prepared without a word."""
    agent = node.agent()

    async def main() -> None:
        async with agent.running():
            node.api.objects[UID_A] = claim_object(CLAIM_A, {"memory": "30Gi", "bogus": "5"})
            outcome = await prepare_one(agent, CLAIM_A)
            assert outcome.devices == ()
            assert (
                "claim ml/train: device gpu-0's consumed capacity names 'bogus', which the devices of "
                f"{DRA_DRIVER} do not have (they have memory, compute and clients)"
            ) in outcome.error
            assert agent.claim_grants() == []
            assert agent.ceilings() == WHOLE
            assert node.spec_uids() == set()
            assert not node.checkpoint.exists()
            assert counters(agent) == (0, 1, 0)

    node.run(main)


# --- MPS's client limit ----------------------------------------------------------------------------------


def test_the_client_limit_counts_device_plugin_grants_and_claims_alike(node: Node) -> None:
    """47 of GPU 0's 48 replicas (1706 MiB each) held by device-plugin grants leave 1738 MiB: a 1 GiB claim is the
    48th MPS client, and the next 1 GiB claim is refused at the client limit (which the accounting asks first)."""
    agent = node.agent()
    allocator = agent.resource.allocator

    async def main() -> None:
        async with agent.running():
            for replica in range(47):
                allocator.allocate([[f"{GPU0}::{replica}"]])
            await agent.resource.set_ceilings()
            assert allocator.ledger.tally.clients(0) == 47
            assert agent.ceilings() == ("2.0", "1G", "80G")  # 1/48 of GPU 0 each: 1706M
            node.api.allocate(
                allocation(CLAIM_A, memory_bytes=GIB),
                allocation(CLAIM_B, memory_bytes=GIB),
                allocation(CLAIM_C, device="gpu-1", memory_bytes=10 * GIB),
            )
            assert (await prepare_one(agent, CLAIM_A)).error == ""
            assert allocator.ledger.tally.clients(0) == 48

            refused = await prepare_one(agent, CLAIM_B)
            assert refused.devices == ()
            assert refused.error == (
                f"claim ml/serve: GPU {GPU0} would hold 49 MPS clients (device-plugin grants and claims), but MPS "
                "serves at most 48; nothing was prepared: the kubelet retries, and the claim is prepared once a "
                "container on the GPU ends (the scheduler does not count MPS clients)"
            )
            assert allocator.ledger.tally.clients(0) == 48
            assert agent.claim_grants() == [(UID_A, "gpu-0", 1024, 1)]
            assert node.spec_uids() == {UID_A}
            assert node.checkpointed() == [UID_A]
            assert counters(agent) == (1, 1, 0)

            # A claim of GPU 1 and GPU 0 holds neither: GPU 0 is full.
            both = ClaimRef(namespace="ml", name="both", uid=STRAY_UID)
            node.api.allocate(
                ClaimAllocation(
                    claim=both,
                    devices=(
                        ClaimDevice(request="gpu", pool=NODE, device="gpu-1", memory_bytes=10 * GIB),
                        ClaimDevice(request="gpu", pool=NODE, device="gpu-0", memory_bytes=GIB),
                    ),
                )
            )
            assert "at most 48" in (await prepare_one(agent, both)).error
            assert allocator.ledger.tally.clients(1) == 0
            assert node.spec_uids() == {UID_A}

            # The limit is per GPU: GPU 1 has room.
            assert (await prepare_one(agent, CLAIM_C)).error == ""
            assert node.checkpointed() == [UID_A, UID_C]

            # One container on GPU 0 ends: the kubelet's retry of the refused claim is prepared.
            (first,) = allocator.ledger.holders([f"{GPU0}::0"])
            allocator.ledger.release([first.grant_id])
            assert (await prepare_one(agent, CLAIM_B)).error == ""
            assert allocator.ledger.tally.clients(0) == 48

    node.run(main)


# --- an agent restart ------------------------------------------------------------------------------------


def test_a_restarted_agent_holds_the_checkpointed_claims_again_and_writes_their_specs_again(node: Node) -> None:
    first = node.agent()
    prepared: dict[str, PrepareOutcome] = {}

    async def before() -> None:
        async with first.running():
            node.api.allocate(
                allocation(CLAIM_A, pods=("ml/trainer-0", "ml/trainer-1")),
                allocation(CLAIM_B, device="gpu-1", memory_bytes=20 * GIB, compute=50, pods=()),
            )
            prepared.update(await first.claims.driver.prepare([CLAIM_A, CLAIM_B]))
            assert first.ceilings() == ("50.0", "30G", "20G")

    node.run(before)
    assert [o.error for o in prepared.values()] == ["", ""]
    envs = {uid: node.spec_env(uid) for uid in (UID_A, UID_B)}
    # Meanwhile: the specs as a power cut may leave them (written without fsync): one gone, one empty.
    cdi.spec_path(node.cdi_dir, UID_A).unlink()
    cdi.spec_path(node.cdi_dir, UID_B).write_text("")
    # And a spec of a claim the checkpoint does not list (its unprepare was lost), and another driver's.
    cdi.write_claim_spec(node.cdi_dir, STRAY_UID, [CdiDevice(name=f"{STRAY_UID}-gpu-0", envs={}, mounts=())])
    (node.cdi_dir / "nvidia.com-gpu.yaml").write_text("cdiVersion: 0.6.0\n")
    node.api.claims.clear()  # the restarted agent must not need the API server for claims it prepared

    second = node.agent()
    assert second.claims.restore() == 2
    assert sorted(second.claim_grants()) == [(UID_A, "gpu-0", 30720, 37), (UID_B, "gpu-1", 20480, 50)]
    assert second.resource.allocator.ceilings() == Ceilings(thread_percentage=50, memory_mib=(30720, 20480))
    assert node.spec_uids() == {UID_A, UID_B}
    assert {uid: node.spec_env(uid) for uid in (UID_A, UID_B)} == envs, "each held claim's spec written again"
    assert (node.cdi_dir / "nvidia.com-gpu.yaml").exists()
    status = second.claims.status()
    assert [(c.uid, c.pods) for c in status.claims] == [(UID_A, ("ml/trainer-0", "ml/trainer-1")), (UID_B, ())]

    async def after() -> None:
        async with second.running():
            assert second.ceilings() == ("50.0", "30G", "20G")  # started at the claims' ceilings
            # The kubelet prepares again after the restart: answered from the checkpoint, nothing held twice.
            assert await second.claims.driver.prepare([CLAIM_A, CLAIM_B]) == prepared
            assert len(second.claim_grants()) == 2
            assert node.api.reads == [CLAIM_A, CLAIM_B]  # the first agent's reads only

            assert await second.claims.driver.unprepare([CLAIM_A]) == {UID_A: ""}
            assert second.claim_grants() == [(UID_B, "gpu-1", 20480, 50)]
            assert second.ceilings() == ("50.0", "80G", "20G")
            assert node.spec_uids() == {UID_B}
            assert node.checkpointed() == [UID_B]
            assert counters(second) == (0, 0, 1)

    node.run(after)


def test_a_corrupt_checkpoint_makes_restore_fail_naming_the_file(node: Node) -> None:
    node.checkpoint.write_text('{"version": 1, "claims": [{"claim": ')
    agent = node.agent()
    with pytest.raises(HostError) as failed:
        agent.claims.restore()
    assert str(node.checkpoint) in str(failed.value)
    assert "delete it" in str(failed.value)
    assert agent.claim_grants() == []


@pytest.mark.parametrize(
    ("edit", "rule"),
    [
        (lambda d: {**d, "gpu": "GPU-gone"}, "is not one of nvidia.com/gpu's"),
        (lambda d: {**d, "memory_mib": 90000}, "90000 MiB is outside the GPU's 1 to 81920 MiB"),
        (lambda d: {**d, "memory_mib": -5}, "has memory_mib -5; it must be at least 1"),
        (lambda d: {**d, "thread_percentage": 1000}, "has thread_percentage 1000; it must be 1 to 100"),
        (lambda d: {**d, "device": "gpu-0"}, "is not GPU"),
        (lambda d: {**d, "resource": "nvidia.com/other"}, "resource nvidia.com/other is not configured"),
        (lambda d: {**d, "kind": "full"}, "marked full, but its figures make it capped"),
    ],
)
def test_a_checkpoint_entry_a_fresh_prepare_would_refuse_is_refused_naming_the_file_and_entry(
    node: Node, edit: Callable[[dict[str, Any]], dict[str, Any]], rule: str
) -> None:
    prepared_by_an_earlier_run(node, allocation(CLAIM_A), allocation(CLAIM_B, device="gpu-1", memory_bytes=20 * GIB))
    claims_written = _claims_of(node.checkpoint)
    claims_written[1]["devices"][0] = edit(claims_written[1]["devices"][0])
    _rewrite(node.checkpoint, claims_written)
    second = node.agent()
    with pytest.raises(HostError) as failed:
        second.claims.restore()
    message = str(failed.value)
    assert message.startswith(f"the DRA checkpoint {node.checkpoint} entry 1 (claim ml/serve) "), message
    assert rule in message
    assert second.claim_grants() == [], "nothing is held from a checkpoint that lies"


def test_claims_that_do_not_fit_their_gpu_together_are_refused_at_restore(node: Node) -> None:
    """Each within its GPU, but 50 + 40 GiB of one 80 GiB GPU: the checkpoint cannot be true."""
    prepared_by_an_earlier_run(
        node, allocation(CLAIM_A, memory_bytes=50 * GIB), allocation(CLAIM_B, memory_bytes=20 * GIB)
    )
    claims_written = _claims_of(node.checkpoint)
    claims_written[1]["devices"][0]["memory_mib"] = 40 * 1024
    _rewrite(node.checkpoint, claims_written)
    with pytest.raises(HostError, match=r"entry 1 .* has 30720 MiB of its 81920 MiB free"):
        node.agent().claims.restore()


def prepared_by_an_earlier_run(node: Node, *allocations: ClaimAllocation) -> None:
    """An agent that prepared these claims in one call and stopped: its checkpoint is what the test starts from."""
    earlier = node.agent()

    async def run() -> None:
        async with earlier.running():
            node.api.allocate(*allocations)
            outcomes = await earlier.claims.driver.prepare([each.claim for each in allocations])
            assert [outcome.error for outcome in outcomes.values()] == [""] * len(allocations)

    node.run(run)


def _claims_of(path: Path) -> list[dict[str, Any]]:
    written: list[dict[str, Any]] = json.loads(msgspec.json.encode(checkpoint.load(path)))
    return written


def _rewrite(path: Path, claims_written: list[dict[str, Any]]) -> None:
    """The checkpoint with an entry changed by hand and its checksum made right again (as by someone who knows the
    format): only the entries' own rules can refuse it."""
    path.write_bytes(checkpoint.encode(msgspec.convert(claims_written, tuple[PreparedClaim, ...])))


def test_with_dra_off_a_checkpoint_of_live_claims_refuses_the_start_naming_them(node: Node) -> None:
    prepared_by_an_earlier_run(node, allocation(CLAIM_A), allocation(CLAIM_B, device="gpu-1", memory_bytes=20 * GIB))
    refusal = live_claims_without_dra(node.checkpoint)
    assert refusal == (
        f"--dra is off, but the DRA checkpoint {node.checkpoint} holds 2 prepared claims (ml/train, ml/serve) whose "
        "pods may still run: without them the MPS daemons' ceilings would drop below those pods' caps. Start with "
        "--dra on until those pods are gone (kubectl delete the pods, or drain the node), or, if none runs any more, "
        "remove the checkpoint"
    )
    node.checkpoint.unlink()
    assert live_claims_without_dra(node.checkpoint) is None


def test_one_prepare_call_is_one_batch_the_daemon_told_once(node: Node) -> None:
    """Three claims in one NodePrepareResources: read at once, and one change of the daemon's ceilings for all."""
    agent = node.agent()
    log = node.plan.resources[0].log_directory / "control.log"

    async def main() -> None:
        async with agent.running():
            node.api.allocate(
                allocation(CLAIM_A, memory_bytes=10 * GIB),
                allocation(CLAIM_B, memory_bytes=20 * GIB),
                allocation(CLAIM_C, device="gpu-1", memory_bytes=30 * GIB),
            )
            before = log.read_text().count("Cmd:set_default_device_pinned_mem_limit 0 ")
            outcomes = await agent.claims.driver.prepare([CLAIM_A, CLAIM_B, CLAIM_C])
            assert [outcome.error for outcome in outcomes.values()] == ["", "", ""]
            assert node.api.most_at_once == 3, "the claims of one call are read concurrently"
            assert log.read_text().count("Cmd:set_default_device_pinned_mem_limit 0 ") == before + 1
            assert agent.ceilings() == ("37.0", "20G", "30G")
            assert node.checkpointed() == [UID_A, UID_B, UID_C]

    node.run(main)


def test_a_claim_of_a_batch_that_fails_holds_nothing_and_the_others_stand(node: Node) -> None:
    agent = node.agent()

    async def main() -> None:
        async with agent.running():
            node.api.allocate(allocation(CLAIM_A, memory_bytes=60 * GIB), allocation(CLAIM_B, memory_bytes=30 * GIB))
            outcomes = await agent.claims.driver.prepare([CLAIM_A, CLAIM_B])
            assert outcomes[UID_A].error == ""
            assert "has 20480 MiB of its 81920 MiB free" in outcomes[UID_B].error
            assert agent.claim_grants() == [(UID_A, "gpu-0", 61440, 75)]
            assert node.spec_uids() == {UID_A} and node.checkpointed() == [UID_A]

    node.run(main)


def test_the_slice_offers_what_device_plugin_grants_leave_and_replicas_are_withheld_beside_claims(node: Node) -> None:
    agent = node.agent()
    allocator = agent.resource.allocator

    async def main() -> None:
        async with agent.running():
            allocator.allocate([[f"{GPU0}::{i}" for i in range(12)]])  # 12 of 48: 20480 MiB, 25 % of the SMs
            node.api.allocate(allocation(CLAIM_A, device="gpu-1", memory_bytes=40 * GIB))
            await prepare_one(agent, CLAIM_A)
            await eventually(agent.resource.inventory.withheld, "GPU 1's replicas withheld")
            devices = {d.name: d for d in agent.claims.slice.devices}
            assert (devices["gpu-0"].memory.value, devices["gpu-0"].compute.value) == (61440 * MIB, 75)
            assert (devices["gpu-1"].memory.value, devices["gpu-1"].compute.value) == (81920 * MIB, 100)
            (withheld,) = agent.resource.inventory.withheld()
            assert (withheld.uuid, len(withheld.replica_ids)) == (GPU1, 24), "40 GiB of 80: 24 of 48 no longer fit"
            offered = [d for d in agent.resource.inventory.snapshot().devices if d.replica_id.startswith(GPU1)]
            assert sum(d.health is Health.HEALTHY for d in offered) == 24
            with structlog.testing.capture_logs() as logs:
                node.api.allocate(allocation(CLAIM_B, device="gpu-0", memory_bytes=50 * GIB))
                await prepare_one(agent, CLAIM_B)  # GPU 0 changes: GPU 1's withheld replicas are not told again
                await agent.claims.driver.unprepare([CLAIM_A])
                await eventually(
                    lambda: [gpu.uuid for gpu in agent.resource.inventory.withheld()] == [GPU0], "GPU 1's offered"
                )
            said = [(e["event"], e["gpu"]) for e in logs if "withheld" in e["event"]]
            assert said == [
                ("replicas withheld beside the claims", GPU0),
                ("withheld replicas offered again", GPU1),
            ]

    node.run(main)


def test_a_failed_gpu_is_tainted_refuses_claims_and_its_devices_health_changes(node: Node) -> None:
    agent = node.agent()

    async def main() -> None:
        async with agent.running():
            assert [(h.device, h.problem) for h in agent.claims.health.device_health()] == [
                ("gpu-0", None),
                ("gpu-1", None),
            ]
            generation = agent.claims.health.health_generation
            agent.resource.inventory.set_gpu_problem(GPU0, "nvml", True, "critical Xid 79")
            with anyio.fail_after(5):  # the claim server looks at the node every 0.2 s
                assert await agent.claims.health.wait_health_changed(generation) == generation + 1
            assert [(h.device, h.problem) for h in agent.claims.health.device_health()] == [
                ("gpu-0", "critical Xid 79"),
                ("gpu-1", None),
            ]
            (taint,) = next(d for d in agent.claims.slice.devices if d.name == "gpu-0").taints
            assert (taint.key, taint.value, taint.effect) == (
                "mps.mpsagent.io/unhealthy",
                "critical-Xid-79",
                "NoSchedule",
            )
            node.api.allocate(allocation(CLAIM_A))
            assert "is unhealthy (critical Xid 79)" in (await prepare_one(agent, CLAIM_A)).error
            generation = agent.claims.health.health_generation
            agent.resource.inventory.set_gpu_problem(GPU0, "nvml", False)
            with anyio.fail_after(5):
                await agent.claims.health.wait_health_changed(generation)
            assert agent.claims.health.device_health()[0].problem is None
            assert next(d for d in agent.claims.slice.devices if d.name == "gpu-0").taints == ()

    node.run(main)


# --- status ----------------------------------------------------------------------------------------------


def test_status_lists_the_claims_with_their_pods_and_devices_and_counts_the_calls(node: Node) -> None:
    agent = node.agent()

    async def main() -> None:
        async with agent.running():
            node.api.allocate(
                allocation(CLAIM_A, pods=("ml/trainer-0",)),
                allocation(CLAIM_B, device="gpu-1", memory_bytes=None, pods=("ml/server-0", "ml/server-1")),
                allocation(CLAIM_C, pool="elsewhere"),
            )
            await agent.claims.driver.prepare([CLAIM_A, CLAIM_B, CLAIM_C])
            await agent.claims.driver.unprepare([CLAIM_A])
            await agent.claims.driver.prepare([CLAIM_A])

    node.run(main)
    status = agent.claims.status()
    assert (status.driver, status.node, status.registered, status.slice_published) == (DRA_DRIVER, NODE, False, False)
    assert (status.prepared, status.refused, status.unprepared) == (3, 1, 1)
    by_uid = {claim.uid: claim for claim in status.claims}
    assert sorted(by_uid) == [UID_A, UID_B]
    a, b = by_uid[UID_A], by_uid[UID_B]
    assert (a.claim, a.pods, b.claim, b.pods) == (
        "ml/train",
        ("ml/trainer-0",),
        "ml/serve",
        ("ml/server-0", "ml/server-1"),
    )
    assert [(d.device, d.gpu, d.resource, d.memory_mib, d.thread_percentage, d.kind) for d in a.devices] == [
        ("gpu-0", GPU0, RESOURCE, 30720, 37, GrantKind.CAPPED)
    ]
    assert [(d.device, d.gpu, d.resource, d.memory_mib, d.thread_percentage, d.kind) for d in b.devices] == [
        ("gpu-1", GPU1, RESOURCE, 81920, 100, GrantKind.FULL)
    ]
    assert a.prepared_at


def test_a_claims_memory_below_a_whole_mib_is_rounded_down_and_the_rounding_said(node: Node) -> None:
    """MPS limits are whole MiB: 8Gi + 1 byte is capped at 8192M, and the prepared claim's log line and `--status`
    say what was left out."""
    agent = node.agent()

    async def main() -> None:
        async with agent.running():
            node.api.allocate(allocation(CLAIM_A, memory_bytes=8 * GIB + 1), allocation(CLAIM_B, memory_bytes=9 * GIB))
            with structlog.testing.capture_logs() as logs:
                await agent.claims.driver.prepare([CLAIM_A, CLAIM_B])
            prepared = {e["claim_uid"]: e["devices"] for e in logs if e["event"] == "claim prepared"}
            assert prepared[UID_A] == [
                "gpu-0: 8192 MiB (the allocation rounded down to whole MiB: 1 byte left out), threads 10%"
            ]
            assert prepared[UID_B] == ["gpu-0: 9216 MiB, threads 11%"]
            assert node.spec_env(UID_A)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=8192M"

    node.run(main)
    by_uid = {claim.uid: claim for claim in agent.claims.status().claims}
    assert [d.rounded_off_bytes for d in by_uid[UID_A].devices] == [1]
    assert [d.rounded_off_bytes for d in by_uid[UID_B].devices] == [0]
    document = status_document(
        version="1",
        pid=1,
        tasks=1,
        pod_resources=PodResourcesStatus(available=True),
        unhealthy_gpus={},
        resources=[],
        dra=agent.claims.status(),
    )
    shown = render_status_text(document).splitlines()
    assert (
        f"      gpu-0 ({GPU0}, {RESOURCE}): 8192 MiB (the allocation rounded down to whole MiB: 1 byte left out), "
        "threads 10%"
    ) in shown
    assert f"      gpu-0 ({GPU0}, {RESOURCE}): 9216 MiB, threads 11%" in shown


def test_at_start_what_is_not_a_spec_file_of_the_agent_is_skipped_not_a_reason_to_stop(node: Node) -> None:
    """A directory, or a link, named like one of the agent's specs: skipped with a warning each (a link never
    removed through); a stale spec file of the agent is still removed."""
    cdi.write_claim_spec(node.cdi_dir, STRAY_UID, [CdiDevice(name=f"{STRAY_UID}-gpu-0", envs={}, mounts=())])
    directory = cdi.spec_path(node.cdi_dir, UID_A)
    directory.mkdir()
    target = node.directory / "elsewhere.json"
    target.write_text("{}")
    link = cdi.spec_path(node.cdi_dir, UID_B)
    link.symlink_to(target)
    agent = node.agent()
    with structlog.testing.capture_logs() as logs:
        assert agent.claims.restore() == 0
    assert not cdi.spec_path(node.cdi_dir, STRAY_UID).exists()
    assert directory.is_dir()
    assert link.is_symlink()
    assert target.read_text() == "{}"
    skipped = [(e["path"], e["log_level"]) for e in logs if e["event"] == "cdi directory entry skipped"]
    assert sorted(skipped) == sorted([(str(directory), "warning"), (str(link), "warning")])


def test_a_prepare_cancelled_at_any_point_leaves_the_node_as_if_it_never_happened(node: Node) -> None:
    """grpclib cancels a handler's task (natively) on the kubelet's deadline or a reset stream: cancelled after
    each number of half milliseconds (the awaits inside are the daemon's sessions and a worker thread's writes), a
    prepare of two claims on two GPUs holds nothing anywhere, or (once it completed) holds them exactly once; the
    kubelet's retry then holds each claim once."""
    agent = node.agent()

    async def main() -> None:
        async with agent.running():
            node.api.allocate(allocation(CLAIM_A), allocation(CLAIM_C, device="gpu-1", memory_bytes=20 * GIB))
            for turns in range(400):
                call = agent.claims.driver.prepare([CLAIM_A, CLAIM_C])
                completed = await cancelled_after(call, seconds=turns / 2000)
                state = (agent.claim_grants(), node.checkpointed(), node.spec_uids(), agent.ceilings())
                if not completed:
                    assert state == ([], [], set(), WHOLE), f"cancelled after {turns} turns"
                    continue
                assert state == (
                    [(UID_A, "gpu-0", 30720, 37), (UID_C, "gpu-1", 20480, 25)],
                    [UID_A, UID_C],
                    {UID_A, UID_C},
                    ("37.0", "30G", "20G"),
                ), f"completed after {turns} turns"
                break
            else:
                pytest.fail("the prepare never completed")
            retried = await agent.claims.driver.prepare([CLAIM_A, CLAIM_C])
            assert [outcome.error for outcome in retried.values()] == ["", ""]
            assert len(agent.claim_grants()) == 2
            assert agent.resource.allocator.ledger.tally.clients(0) == 1

    node.run(main)
