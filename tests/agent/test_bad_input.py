"""Bad input gets a clear answer and loses nothing: arbitrary device-ID lists at Allocate and
GetPreferredAllocation (in the domain code and through the agent's real socket), arbitrary config documents at
the command line, and unexpected exceptions inside an RPC."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import anyio
import grpc
import pytest
import yaml
from grpclib.server import Server
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from mpsagent.base.config import check_config, parse_config
from mpsagent.base.devices import NodeGpus
from mpsagent.base.errors import RequestError
from mpsagent.deviceplugin.servicer import DevicePluginServicer
from mpsagent.domain.allocation import ResourceAllocator
from mpsagent.domain.inventory import Inventory
from mpsagent.domain.plan import build_plan
from mpsagent.gpu.snapshot import SnapshotGpuSource
from mpsagent_testing.agents import AgentLauncher, start_agent
from mpsagent_testing.kubelet.fake import FakeKubelet, Plugin
from mpsagent_testing.kubelet.stubs import dp_grpc, dp_pb2
from mpsagent_testing.node import ALL, RESOURCE, config, small_node
from mpsagent_testing.repo import BUILD, H100_NODE, ROOT
from mpsagent_testing.strategies import config_like, json_values

ODD = ["", " ", "::", "GPU-x::", "::0", "GPU-00000000-aaaa-bbbb-cccc-dddddddddddd::99", "é::1", "\u202e::0", "\x00"]
FOREIGN = ["example.com/nic::0", "MIG-GPU-1/0/0", "GPU-ffffffff::0"]
device_ids = st.sampled_from(ALL) | st.sampled_from(ODD + FOREIGN) | st.text(max_size=40)
id_lists = st.lists(device_ids, max_size=12) | st.lists(st.sampled_from(ALL), max_size=20)
THOUSANDS = [f"GPU-{i:08d}::{i % 7}" for i in range(3000)]
BUILD.mkdir(parents=True, exist_ok=True)


SMALL_NODE = small_node(BUILD / "bad-input-node.json")


def allocator(fail_gt_one: bool) -> ResourceAllocator:
    node: NodeGpus = SnapshotGpuSource(SMALL_NODE).discover()
    text = (
        "version: v1\nsharing:\n  mps:\n"
        f"    failRequestsGreaterThanOne: {str(fail_gt_one).lower()}\n"
        "    resources:\n    - name: gpu\n      replicas: 4\n"
    )
    plan = build_plan(check_config(parse_config(text, "t.yaml")), node, Path("/run/mps"))
    return ResourceAllocator(plan.resources[0], plan.shm_directory)


def ledger_state(a: ResourceAllocator) -> object:
    return (
        [(g.grant_id, g.replica_ids, g.kind) for g in a.ledger.live_grants()],
        a.ledger.statistics(),
    )


@settings(max_examples=300, deadline=None)
@given(fail_gt_one=st.booleans(), requests=st.lists(id_lists, max_size=4), data=st.data())
@example(fail_gt_one=False, requests=[THOUSANDS], data=None)
@example(fail_gt_one=False, requests=[ALL[:1] * 500], data=None)
def test_allocate_answers_or_refuses_with_a_message_and_a_refusal_changes_nothing(
    fail_gt_one: bool, requests: list[list[str]], data: st.DataObject | None
) -> None:
    a = allocator(fail_gt_one)
    if data is not None:  # some live grants first, so that "changes nothing" has something to keep
        for ids in data.draw(st.lists(st.lists(st.sampled_from(ALL[:4]), min_size=1, max_size=1), max_size=3)):
            a.allocate([ids])
    before = ledger_state(a)
    try:
        allocations = a.allocate(requests)
    except RequestError as exc:
        assert str(exc).strip()
        assert len(str(exc)) < 1024  # a gRPC status message, not a dump of the request
        assert ledger_state(a) == before
        return
    assert len(allocations) == len(requests)
    for allocation, ids in zip(allocations, requests, strict=True):
        assert set(allocation.setup.replica_ids) == set(ids)


@settings(max_examples=300, deadline=None)
@given(
    earlier=st.lists(st.lists(st.sampled_from(ALL), min_size=1, max_size=8), max_size=5),
    requests=st.lists(st.lists(st.sampled_from(ALL), min_size=1, max_size=8), min_size=1, max_size=3),
)
def test_a_withdrawn_allocate_leaves_the_ledger_as_it_was(earlier: list[list[str]], requests: list[list[str]]) -> None:
    """An Allocate answered with an error (its cap switch failed) is withdrawn, whatever grants it ended."""
    a = allocator(False)
    for ids in earlier:
        a.allocate([ids])

    def state() -> object:
        live = sorted(a.ledger.live_grants(), key=lambda g: g.grant_id)
        holders = {r: g.grant_id for r in ALL if (g := a.ledger.holder(r))}
        return [(g.grant_id, g.replica_ids, g.kind) for g in live], holders, a.ledger.statistics(), a.ceilings()

    before = state()
    a.withdraw(a.allocate(requests))
    assert state() == before


def test_a_withdrawal_leaves_alone_what_later_grants_did_meanwhile() -> None:
    """While a failing Allocate waited for its cap switch, another Allocate took its replicas: that one stands."""
    a = allocator(False)
    a.allocate([ALL[:1]])
    failing = a.allocate([ALL[:2]])  # ends the first grant
    later = a.allocate([ALL[1:3]])  # ends the failing one meanwhile
    a.withdraw(failing)
    assert [(g.grant_id, g.replica_ids) for g in a.ledger.live_grants()] == [(3, tuple(ALL[1:3]))]
    stats = a.ledger.statistics()
    made = sum(stats.grants.values()) + stats.adopted_grants
    assert made == sum(stats.live_grants.values()) + stats.superseded_grants + stats.released_grants == 3
    assert later[0].record.ended[0].grant_id == 2


@settings(max_examples=300, deadline=None)
@given(
    available=id_lists,
    must=id_lists,
    size=st.integers(-3, 60),
    fail_gt_one=st.booleans(),
)
@example(available=THOUSANDS, must=[], size=5, fail_gt_one=False)
def test_preferred_allocation_answers_exactly_or_refuses_with_a_message(
    available: list[str], must: list[str], size: int, fail_gt_one: bool
) -> None:
    a = allocator(fail_gt_one)
    before = ledger_state(a)
    try:
        chosen = a.preferred(available, must, size)
    except RequestError as exc:
        assert str(exc).strip() and len(str(exc)) < 1024
    else:
        assert len(chosen) == size == len(set(chosen))
        assert set(chosen) <= set(available) | set(must)
    assert ledger_state(a) == before


# --- through the agent's socket -----------------------------------------------------------------------------


@pytest.fixture
def served(agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path):
    agent = start_agent(agents, kubelet, short_dir, config())
    return agent, kubelet.wait_registered(RESOURCE)


def call(plugin: Plugin, method: str, request: object) -> tuple[grpc.StatusCode, object]:
    try:
        return grpc.StatusCode.OK, getattr(plugin.stub, method)(request, timeout=10)
    except grpc.RpcError as exc:
        return exc.code(), exc.details()


def test_arbitrary_requests_through_the_socket_get_an_answer_or_invalid_argument(served) -> None:
    agent, plugin = served
    granted_containers = 0

    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
    @given(requests=st.lists(id_lists, max_size=3))
    @example(requests=[THOUSANDS])
    @example(requests=[[]])
    def allocate(requests: list[list[str]]) -> None:
        nonlocal granted_containers
        request = dp_pb2.AllocateRequest(
            container_requests=[dp_pb2.ContainerAllocateRequest(devices_ids=ids) for ids in requests]
        )
        code, answer = call(plugin, "Allocate", request)
        assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), (code, answer)
        if code is grpc.StatusCode.OK:
            assert len(answer.container_responses) == len(requests)
            granted_containers += len(requests)
        else:
            assert (isinstance(answer, str) and answer.startswith(RESOURCE)) or "request" in answer

    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
    @given(available=id_lists, must=id_lists, size=st.integers(-3, 40))
    def preferred(available: list[str], must: list[str], size: int) -> None:
        request = dp_pb2.PreferredAllocationRequest(
            container_requests=[
                dp_pb2.ContainerPreferredAllocationRequest(
                    available_deviceIDs=available, must_include_deviceIDs=must, allocation_size=size
                )
            ]
        )
        code, answer = call(plugin, "GetPreferredAllocation", request)
        assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), (code, answer)
        if code is grpc.StatusCode.OK:
            assert len(answer.container_responses[0].deviceIDs) == size

    allocate()
    preferred()
    events = agent.log_events()
    # Every granted container, and nothing refused, reached the ledger.
    assert len([e for e in events if e.get("event") == "granted"]) == granted_containers
    assert not [e for e in events if "unexpectedly" in str(e.get("event"))]
    assert agent.process.poll() is None


# --- config documents at the command line --------------------------------------------------------------------


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(document=json_values | config_like, as_yaml=st.booleans())
def test_any_config_document_exits_0_or_2_with_a_message_never_a_traceback(
    tmp_path_factory: pytest.TempPathFactory, document: object, as_yaml: bool
) -> None:
    path = tmp_path_factory.mktemp("fuzz") / "config.yaml"
    path.write_text(yaml.safe_dump(document) if as_yaml else json.dumps(document))
    result = subprocess.run(
        [sys.executable, "-m", "mpsagent", "--once", "--node-snapshot", str(H100_NODE), "--config-file", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )
    assert result.returncode in (0, 2), result.stderr
    assert "Traceback" not in result.stderr
    if result.returncode == 2:
        assert result.stderr.startswith("mpsagent: error: ")


@settings(max_examples=300, deadline=None)
@given(document=config_like)
def test_any_config_document_that_parses_plans_or_names_the_key(document: object) -> None:
    from mpsagent.base.errors import ConfigError  # noqa: PLC0415

    node = SnapshotGpuSource(H100_NODE).discover()
    try:
        build_plan(check_config(parse_config(json.dumps(document), "fuzz.yaml")), node, Path("/run/mps"))
    except ConfigError as exc:
        assert str(exc).strip()


# --- an unexpected exception inside an RPC ----------------------------------------------------------------------


class ExplodingAllocator(ResourceAllocator):
    def allocate(self, requests):
        raise ZeroDivisionError("a bug")

    def preferred(self, available, must_include, size):
        raise KeyError("another bug")


class ExplodingInventory(Inventory):
    def snapshot(self):
        raise IndexError("a third bug")


def test_an_unexpected_exception_is_logged_with_context_and_answered_internal(
    short_dir: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    real = allocator(False)
    exploding = ExplodingAllocator(real.resource, Path("/run/mps/shm"))
    servicer = DevicePluginServicer(exploding, ExplodingInventory(real.resource, daemon_ready=True))
    socket = short_dir / "plugin.sock"
    answers: dict[str, tuple[grpc.StatusCode, str]] = {}

    def client() -> None:
        with grpc.insecure_channel(f"unix://{socket}") as channel:
            stub = dp_grpc.DevicePluginStub(channel)
            for name, method, request in (
                ("allocate", stub.Allocate, dp_pb2.AllocateRequest(container_requests=[])),
                (
                    "preferred",
                    stub.GetPreferredAllocation,
                    dp_pb2.PreferredAllocationRequest(
                        container_requests=[dp_pb2.ContainerPreferredAllocationRequest(allocation_size=1)]
                    ),
                ),
            ):
                try:
                    method(request, timeout=10)
                except grpc.RpcError as exc:
                    answers[name] = (exc.code(), exc.details())
            try:
                list(stub.ListAndWatch(dp_pb2.Empty(), timeout=10))
            except grpc.RpcError as exc:
                answers["watch"] = (exc.code(), exc.details())

    async def main() -> None:
        server = Server([servicer])
        await server.start(path=str(socket))
        try:
            thread = threading.Thread(target=client)
            thread.start()
            with anyio.fail_after(20):
                while thread.is_alive():
                    await anyio.sleep(0.01)
        finally:
            servicer.close()
            server.close()
            await server.wait_closed()

    anyio.run(main)
    for name in ("allocate", "preferred", "watch"):
        code, details = answers[name]
        assert code is grpc.StatusCode.INTERNAL
        assert len(details) < 120 and "mpsagent log" in details and "bug" not in details
    logged = "".join(capfd.readouterr())
    assert "ZeroDivisionError: a bug" in logged and "KeyError: 'another bug'" in logged and "a third bug" in logged
    assert "nvidia.com/gpu" in logged  # the resource is part of the context
