"""The DRA endpoint (mpsagent.dra) on real unix sockets in a temporary kubelet directory, driven by grpcio as the
kubelet: the plugin registry's GetInfo and NotifyRegistrationStatus, the DRA node service's NodePrepareResources
and NodeUnprepareResources over a test double of the claim handler (the real one is the supervisor's), the bounds on
what the kubelet sends, and the socket files' life (stale ones replaced, a removed one served again, both removed
at the end)."""

from __future__ import annotations

import concurrent.futures
import shutil
import socket
import stat
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import grpc
import pytest
from anyio.from_thread import BlockingPortal, start_blocking_portal
from structlog.testing import capture_logs

from mpsagent.base.errors import HostError
from mpsagent.domain.claims import DRA_DRIVER, ClaimRef, PreparedDevice
from mpsagent.domain.grant_kind import GrantKind
from mpsagent.dra.endpoint import DraEndpoint
from mpsagent.dra.health_service import MAX_STREAMS, DeviceHealth
from mpsagent.dra.node_service import MAX_CLAIMS, NO_OUTCOME, RECEIVE_LIMIT, SERVICE, PrepareOutcome
from mpsagent_testing.kubelet.stubs import (
    dra_grpc,
    dra_pb2,
    health_alpha_grpc,
    health_alpha_pb2,
    health_grpc,
    health_pb2,
    reg_grpc,
    reg_pb2,
)
from mpsagent_testing.waiting import wait_for

CALL_TIMEOUT_S = 5
STOP_TIMEOUT_S = 5
WATCH_INTERVAL_S = 0.05


def prepared(request: str, device: str, share_id: str | None, *cdi: str) -> PreparedDevice:
    return PreparedDevice(
        request=request,
        pool="node-a",
        device=device,
        share_id=share_id,
        cdi_device_ids=cdi,
        resource="nvidia.com/gpu",
        gpu="GPU-0",
        memory_mib=1024,
        thread_percentage=25,
        kind=GrantKind.CAPPED,
    )


@dataclass
class FakeClaimHandler:
    """Answers from `outcomes` and `unprepare_errors` (a claim not in them: prepared with no device, unprepared),
    records every call, and raises `failing` when set."""

    outcomes: dict[str, PrepareOutcome] = field(default_factory=dict)
    unprepare_errors: dict[str, str] = field(default_factory=dict)
    leave_out: set[str] = field(default_factory=set)
    failing: Exception | None = None
    prepare_calls: list[list[ClaimRef]] = field(default_factory=list)
    unprepare_calls: list[list[ClaimRef]] = field(default_factory=list)

    async def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, PrepareOutcome]:
        self.prepare_calls.append(list(claims))
        if self.failing is not None:
            raise self.failing
        return {c.uid: self.outcomes.get(c.uid, PrepareOutcome()) for c in claims if c.uid not in self.leave_out}

    async def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, str]:
        self.unprepare_calls.append(list(claims))
        if self.failing is not None:
            raise self.failing
        return {c.uid: self.unprepare_errors.get(c.uid, "") for c in claims if c.uid not in self.leave_out}


@dataclass
class Running:
    endpoint: DraEndpoint
    handler: FakeClaimHandler
    portal: BlockingPortal
    task: concurrent.futures.Future[Any]

    def stop(self) -> float:
        """Cancel the endpoint's task and wait (bounded) for it to end; how long it took."""
        began = time.monotonic()
        self.task.cancel()
        done, _ = concurrent.futures.wait([self.task], timeout=STOP_TIMEOUT_S)
        assert done, f"the endpoint did not end within {STOP_TIMEOUT_S}s of its cancellation"
        return time.monotonic() - began

    def registry(self) -> Any:
        return reg_grpc.RegistrationStub(_channel(self.endpoint.registration_socket))

    def dra(self) -> Any:
        return dra_grpc.DRAPluginStub(_channel(self.endpoint.dra_socket))


_channels: list[grpc.Channel] = []


def _channel(path: Path) -> grpc.Channel:
    channel = grpc.insecure_channel(f"unix://{path}")
    _channels.append(channel)
    return channel


@pytest.fixture(autouse=True)
def _close_channels() -> Iterator[None]:
    yield
    while _channels:
        _channels.pop().close()


@pytest.fixture
def kubelet_dir() -> Iterator[Path]:
    """A kubelet directory with a short path (unix socket paths are limited to 107 bytes)."""
    top = Path(tempfile.mkdtemp(prefix="mpdra", dir="/tmp"))
    yield top / "kubelet"
    shutil.rmtree(top, ignore_errors=True)


def start(kubelet_dir: Path, portal: BlockingPortal, handler: FakeClaimHandler | None = None) -> Running:
    handler = handler or FakeClaimHandler()
    endpoint = DraEndpoint(
        kubelet_dir=kubelet_dir, driver=DRA_DRIVER, handler=handler, watch_interval_s=WATCH_INTERVAL_S
    )
    task, _ = portal.start_task(endpoint.run)
    return Running(endpoint, handler, portal, task)


@pytest.fixture
def running(kubelet_dir: Path) -> Iterator[Running]:
    with start_blocking_portal() as portal:
        served = start(kubelet_dir, portal)
        try:
            yield served
        finally:
            served.stop()


def claim(uid: str, *, namespace: str = "default", name: str | None = None) -> Any:
    return dra_pb2.Claim(namespace=namespace, name=name or f"claim-{uid}", uid=uid)


def ref(uid: str) -> ClaimRef:
    return ClaimRef(namespace="default", name=f"claim-{uid}", uid=uid)


def prepare(served: Running, *claims: Any) -> Any:
    return served.dra().NodePrepareResources(dra_pb2.NodePrepareResourcesRequest(claims=claims), timeout=CALL_TIMEOUT_S)


def unprepare(served: Running, *claims: Any) -> Any:
    return served.dra().NodeUnprepareResources(
        dra_pb2.NodeUnprepareResourcesRequest(claims=claims), timeout=CALL_TIMEOUT_S
    )


def refused_prepare(served: Running, *claims: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as error:
        prepare(served, *claims)
    return error.value


def get_info(served: Running) -> Any:
    return served.registry().GetInfo(reg_pb2.InfoRequest(), timeout=CALL_TIMEOUT_S)


def notify(served: Running, registered: bool, error: str = "") -> None:
    served.registry().NotifyRegistrationStatus(
        reg_pb2.RegistrationStatus(plugin_registered=registered, error=error), timeout=CALL_TIMEOUT_S
    )


def is_socket(path: Path) -> bool:
    try:
        return stat.S_ISSOCK(path.lstat().st_mode)
    except FileNotFoundError:
        return False


# --- registration ----------------------------------------------------------------------------------------------


def test_get_info_names_the_driver_and_its_dra_socket(running: Running, kubelet_dir: Path) -> None:
    info = get_info(running)
    dra_socket = kubelet_dir / "plugins" / DRA_DRIVER / "dra.sock"
    assert (info.type, info.name, info.endpoint) == ("DRAPlugin", DRA_DRIVER, str(dra_socket))
    assert list(info.supported_versions) == ["v1.DRAPlugin"]
    assert running.endpoint.dra_socket == dra_socket
    assert running.endpoint.registration_socket == kubelet_dir / "plugins_registry" / f"{DRA_DRIVER}-reg.sock"
    for path in (dra_socket, running.endpoint.registration_socket):
        assert stat.S_ISSOCK(path.stat().st_mode)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert running.endpoint.registration.statistics().registered is False


def test_the_kubelets_registration_status_is_kept(running: Running) -> None:
    def registered() -> tuple[bool, str]:
        now = running.endpoint.registration.statistics()
        return now.registered, now.last_error

    notify(running, True)
    assert registered() == (True, "")
    notify(running, False, "boom")
    assert registered() == (False, "boom")
    stats = running.endpoint.registration.statistics()
    assert (stats.registrations, stats.registration_failures) == (1, 1)
    notify(running, True)
    assert registered() == (True, "")


# --- prepare and unprepare -------------------------------------------------------------------------------------


def test_prepare_answers_each_claims_devices_or_its_error(running: Running) -> None:
    cdi_a = "mpsagent.io/mps-share=0aa0-0001-gpu-0"
    running.handler.outcomes = {
        "0aa0-0001": PrepareOutcome(
            devices=(prepared("gpu", "gpu-0", "share-1", cdi_a), prepared("gpu/sub", "gpu-1", None, "x=1", "x=2"))
        ),
        "0bb0-0002": PrepareOutcome(error="no GPU has 40 GiB free"),
    }
    response = prepare(running, claim("0aa0-0001"), claim("0bb0-0002", namespace="team-b", name="big"))
    assert sorted(response.claims) == ["0aa0-0001", "0bb0-0002"]
    a, b = response.claims["0aa0-0001"], response.claims["0bb0-0002"]
    assert a.error == ""
    first, second = a.devices
    assert (list(first.request_names), first.pool_name, first.device_name) == (["gpu"], "node-a", "gpu-0")
    assert (list(first.cdi_device_ids), first.HasField("share_id"), first.share_id) == ([cdi_a], True, "share-1")
    assert (list(second.request_names), second.device_name, list(second.cdi_device_ids)) == (
        ["gpu/sub"],
        "gpu-1",
        ["x=1", "x=2"],
    )
    assert not second.HasField("share_id")
    assert (b.error, list(b.devices)) == ("no GPU has 40 GiB free", [])
    assert running.handler.prepare_calls == [
        [ref("0aa0-0001"), ClaimRef(namespace="team-b", name="big", uid="0bb0-0002")]
    ]


def test_a_claim_given_twice_is_prepared_once(running: Running) -> None:
    response = prepare(running, claim("0aa0-0001"), claim("0bb0-0002"), claim("0aa0-0001"))
    assert sorted(response.claims) == ["0aa0-0001", "0bb0-0002"]
    assert running.handler.prepare_calls == [[ref("0aa0-0001"), ref("0bb0-0002")]]


def test_a_claim_the_handler_leaves_out_is_answered_as_failed(running: Running) -> None:
    running.handler.leave_out = {"0bb0-0002"}
    response = prepare(running, claim("0aa0-0001"), claim("0bb0-0002"))
    assert (response.claims["0aa0-0001"].error, response.claims["0bb0-0002"].error) == ("", NO_OUTCOME)
    response = unprepare(running, claim("0aa0-0001"), claim("0bb0-0002"))
    assert (response.claims["0aa0-0001"].error, response.claims["0bb0-0002"].error) == ("", NO_OUTCOME)


def test_unprepare_answers_every_claim(running: Running) -> None:
    running.handler.unprepare_errors = {"0bb0-0002": "the MPS daemon did not answer"}
    response = unprepare(running, claim("0aa0-0001"), claim("0bb0-0002"), claim("0aa0-0001"))
    assert sorted(response.claims) == ["0aa0-0001", "0bb0-0002"]
    assert response.claims["0aa0-0001"].error == ""
    assert response.claims["0bb0-0002"].error == "the MPS daemon did not answer"
    assert running.handler.unprepare_calls == [[ref("0aa0-0001"), ref("0bb0-0002")]]


def test_an_empty_request_is_answered_without_the_handler(running: Running) -> None:
    assert dict(prepare(running).claims) == {}
    assert dict(unprepare(running).claims) == {}
    assert running.handler.prepare_calls == running.handler.unprepare_calls == []


# --- bounds ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("claims", "named"),
    [
        ([claim(f"0000-{i:04x}") for i in range(MAX_CLAIMS + 1)], f"{MAX_CLAIMS + 1} claims in one request"),
        ([claim("0aa0-0001"), claim("0bb0-0002", namespace="n" * 300)], "claims[1].namespace is 300 characters long"),
        ([claim("0aa0-0001", name="c" * 254)], "claims[0].name is 254 characters long"),
        ([claim("a" * 65)], "claims[0].uid is 65 characters long"),
        ([claim("", name="c")], "claims[0].uid is empty"),
        ([claim("../etc", name="c")], "claims[0].uid '../etc' is not"),
        ([claim("0aa0-0001", namespace="Not_A_Name")], "claims[0].namespace 'Not_A_Name' is not a DNS name"),
        ([claim("0aa0-0001"), claim("0aa0-0001", name="other")], "claims[1]: UID 0aa0-0001 names both"),
    ],
)
def test_a_request_outside_the_bounds_is_refused_by_name_and_reaches_no_handler(
    running: Running, claims: list[Any], named: str
) -> None:
    error = refused_prepare(running, *claims)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in error.details()
    assert len(error.details()) < 300
    with pytest.raises(grpc.RpcError) as unprepared:
        unprepare(running, *claims)
    assert unprepared.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in unprepared.value.details()
    assert running.handler.prepare_calls == running.handler.unprepare_calls == []


def test_the_largest_request_within_the_bounds_is_answered(running: Running) -> None:
    claims = [claim(f"{i:03d}" + "a" * 61, namespace="n" * 253, name="c" * 253) for i in range(MAX_CLAIMS)]
    assert len(prepare(running, *claims).claims) == MAX_CLAIMS


# --- failures of the handler -----------------------------------------------------------------------------------


def _raw_prepare(served: Running, body: bytes) -> grpc.RpcError:
    """NodePrepareResources with `body` as the message, whatever it is."""
    call = _channel(served.endpoint.dra_socket).unary_unary(f"/{SERVICE}/NodePrepareResources")
    with pytest.raises(grpc.RpcError) as info:
        call(body, timeout=10)
    return info.value


def test_a_request_larger_than_any_within_the_bounds_is_refused_unread(running: Running) -> None:
    """grpclib reads any message whole: the service refuses one longer than RECEIVE_LIMIT from its length prefix."""
    error = _raw_prepare(running, b"\n" * (RECEIVE_LIMIT + 1))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"larger than the {RECEIVE_LIMIT} bytes" in (error.details() or "")
    assert running.handler.prepare_calls == []


@pytest.mark.parametrize(
    ("body", "said"),
    [
        (b"\x0a\x03\x0a\x01\xff", "not a valid protobuf message"),  # a namespace that is not UTF-8
        (b"\x0b", "claims[0] is not a claim"),  # a claim's tag with nothing after it
    ],
)
def test_a_request_that_is_not_a_kubelets_is_refused(running: Running, body: bytes, said: str) -> None:
    error = _raw_prepare(running, body)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert said in (error.details() or "")
    assert running.handler.prepare_calls == []


def test_an_unexpected_handler_failure_is_internal_with_a_short_message(running: Running) -> None:
    running.handler.failing = RuntimeError("a bug with a very long story " * 100)
    error = refused_prepare(running, claim("0aa0-0001"))
    assert error.code() == grpc.StatusCode.INTERNAL
    assert error.details() == "internal error in NodePrepareResources; the mpsagent log has the details"


def test_an_agent_error_of_the_handler_is_unavailable_with_its_message(running: Running) -> None:
    running.handler.failing = HostError("the claim checkpoint cannot be written")
    with pytest.raises(grpc.RpcError) as error:
        unprepare(running, claim("0aa0-0001"))
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    assert error.value.details() == "NodeUnprepareResources: the claim checkpoint cannot be written"


# --- the socket files ------------------------------------------------------------------------------------------


def test_both_socket_files_are_removed_when_the_endpoint_is_cancelled(kubelet_dir: Path) -> None:
    with start_blocking_portal() as portal:
        served = start(kubelet_dir, portal)
        notify(served, True)
        took = served.stop()
    assert took < 2 * STOP_TIMEOUT_S / 3
    assert not served.endpoint.dra_socket.exists()
    assert not served.endpoint.registration_socket.exists()
    assert served.endpoint.registration.statistics().registered is False


def test_a_removed_registration_socket_is_served_again(running: Running) -> None:
    notify(running, True)
    running.endpoint.registration_socket.unlink()
    wait_for(lambda: is_socket(running.endpoint.registration_socket), what="the registration socket again")
    # The kubelet registers the plugin anew through the new socket.
    assert running.endpoint.registration.statistics().registered is False
    assert get_info(running).name == DRA_DRIVER
    notify(running, True)
    assert running.endpoint.registration.statistics().registered is True


def test_a_removed_dra_socket_is_served_again(running: Running) -> None:
    running.endpoint.dra_socket.unlink()
    wait_for(lambda: is_socket(running.endpoint.dra_socket), what="the DRA socket again")
    assert sorted(prepare(running, claim("0aa0-0001")).claims) == ["0aa0-0001"]


def test_stale_socket_files_are_replaced(kubelet_dir: Path) -> None:
    paths = [
        kubelet_dir / "plugins" / DRA_DRIVER / "dra.sock",
        kubelet_dir / "plugins_registry" / f"{DRA_DRIVER}-reg.sock",
    ]
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        with socket.socket(socket.AF_UNIX) as stale:
            stale.bind(str(path))  # closed without unlinking: what a killed agent leaves
    with start_blocking_portal() as portal:
        served = start(kubelet_dir, portal)
        try:
            assert get_info(served).name == DRA_DRIVER
            assert sorted(prepare(served, claim("0aa0-0001")).claims) == ["0aa0-0001"]
        finally:
            served.stop()


def test_something_else_than_a_socket_in_the_way_is_an_error_at_the_start(kubelet_dir: Path) -> None:
    path = kubelet_dir / "plugins" / DRA_DRIVER / "dra.sock"
    path.parent.mkdir(parents=True)
    path.write_text("not a socket")
    with start_blocking_portal() as portal, pytest.raises(HostError, match="something else than a socket"):
        start(kubelet_dir, portal)
    assert path.read_text() == "not a socket"
    assert not (kubelet_dir / "plugins_registry" / f"{DRA_DRIVER}-reg.sock").exists()


def test_a_driver_name_that_is_no_dns_name_is_refused(kubelet_dir: Path) -> None:
    with pytest.raises(ValueError, match="not a DRA driver name"):
        DraEndpoint(kubelet_dir=kubelet_dir, driver="../evil", handler=FakeClaimHandler())


def test_a_socket_that_cannot_be_served_again_is_tried_again(running: Running) -> None:
    path = running.endpoint.registration_socket
    with capture_logs() as logs:
        path.unlink()
        path.write_text("in the way")
        failed = [{"event": "removed socket not served again", "log_level": "error"}]
        wait_for(lambda: [{k: e[k] for k in failed[0]} for e in logs if e["event"] == failed[0]["event"]] == failed)
        assert path.read_text() == "in the way"  # not removed: it is not a socket
        path.unlink()
        wait_for(lambda: is_socket(path), what="the registration socket again")
        assert get_info(running).name == DRA_DRIVER
        assert [e["event"] for e in logs if "served again" in e["event"]] == [
            "removed socket not served again",
            "removed socket served again",
        ]


# --- the devices' health (v1.DRAResourceHealth and v1alpha1) ------------------------------------------------------


class FakeHealth:
    """Device health that a test changes (from its own thread, through the portal)."""

    def __init__(self) -> None:
        self.devices = [DeviceHealth(pool="node-a", device="gpu-0", problem=None)]
        self.generation = 0
        self._changed: anyio.Event | None = None

    def device_health(self) -> Sequence[DeviceHealth]:
        return list(self.devices)

    @property
    def health_generation(self) -> int:
        return self.generation

    async def wait_health_changed(self, since: int) -> int:
        while self.generation == since:
            self._changed = self._changed or anyio.Event()
            await self._changed.wait()
        return self.generation

    async def set_problem(self, problem: str | None) -> None:
        self.devices = [DeviceHealth(pool="node-a", device="gpu-0", problem=problem)]
        self.generation += 1
        if self._changed is not None:
            self._changed.set()
            self._changed = None


@pytest.fixture
def watched(kubelet_dir: Path) -> Iterator[tuple[Running, FakeHealth]]:
    health = FakeHealth()
    with start_blocking_portal() as portal:
        endpoint = DraEndpoint(
            kubelet_dir=kubelet_dir,
            driver=DRA_DRIVER,
            handler=FakeClaimHandler(),
            health=health,
            watch_interval_s=WATCH_INTERVAL_S,
        )
        task, _ = portal.start_task(endpoint.run)
        served = Running(endpoint, FakeClaimHandler(), portal, task)
        try:
            yield served, health
        finally:
            served.stop()


V1 = "v1.DRAResourceHealth"
V1ALPHA1 = "v1alpha1.DRAResourceHealth"
HEALTH_STUBS = {V1: (health_pb2, health_grpc), V1ALPHA1: (health_alpha_pb2, health_alpha_grpc)}
"""Each version's messages and stub, as kubelet 1.37 (v1) and 1.36 (v1alpha1) call them."""


def watch(served: Running, service: str = V1) -> Any:
    messages, stubs = HEALTH_STUBS[service]
    stub = stubs.DRAResourceHealthStub(_channel(served.endpoint.dra_socket))
    return stub.NodeWatchResources(messages.NodeWatchResourcesRequest(), timeout=CALL_TIMEOUT_S)


def shown(message: Any) -> list[tuple[str, str, int, str, int]]:
    """What a health message says of each device: its pool and name, health, message and timeout."""
    return [
        (d.device.pool_name, d.device.device_name, d.health, d.message, d.health_check_timeout_seconds)
        for d in message.devices
    ]


def test_the_registration_lists_both_health_versions_newest_first(watched: tuple[Running, FakeHealth]) -> None:
    served, _ = watched
    assert list(get_info(served).supported_versions) == ["v1.DRAPlugin", V1, V1ALPHA1]


def test_both_health_versions_stream_the_same_health_and_say_which_is_watched(
    watched: tuple[Running, FakeHealth],
) -> None:
    served, health = watched
    service = served.endpoint.health_service
    assert service is not None
    with capture_logs() as logs:
        v1, alpha = watch(served, V1), watch(served, V1ALPHA1)
        healthy = [("node-a", "gpu-0", health_pb2.HEALTHY, "", 30)]
        assert shown(next(v1)) == shown(next(alpha)) == healthy
        served.portal.call(health.set_problem, "critical Xid 79")
        unhealthy = [("node-a", "gpu-0", health_pb2.UNHEALTHY, "critical Xid 79", 30)]
        assert shown(next(v1)) == shown(next(alpha)) == unhealthy
        assert sorted(service.watched) == [V1, V1ALPHA1]
        assert sorted(e["service"] for e in logs if e["event"] == "device health watched") == [V1, V1ALPHA1]
    alpha.cancel()
    wait_for(lambda: service.watched == (V1,), what="the v1alpha1 stream's end")
    v1.cancel()
    wait_for(lambda: service.watched == (), what="the v1 stream's end")


def test_the_health_stream_gives_every_device_then_each_change(watched: tuple[Running, FakeHealth]) -> None:
    served, health = watched
    stream = watch(served)
    first = next(stream)
    (device,) = first.devices
    assert (device.device.pool_name, device.device.device_name) == ("node-a", "gpu-0")
    assert (device.health, device.message, device.health_check_timeout_seconds) == (health_pb2.HEALTHY, "", 30)
    assert abs(device.last_updated_time - time.time()) < 5
    served.portal.call(health.set_problem, "critical Xid 79")
    (device,) = next(stream).devices
    assert (device.health, device.message) == (health_pb2.UNHEALTHY, "critical Xid 79")
    served.portal.call(health.set_problem, None)
    assert next(stream).devices[0].health == health_pb2.HEALTHY
    stream.cancel()


def test_the_health_stream_repeats_itself_before_the_kubelet_counts_a_device_unknown(kubelet_dir: Path) -> None:
    health = FakeHealth()
    with start_blocking_portal() as portal:
        endpoint = DraEndpoint(kubelet_dir=kubelet_dir, driver=DRA_DRIVER, handler=FakeClaimHandler(), health=health)
        assert endpoint.health_service is not None
        endpoint.health_service._resend = 0.1
        task, _ = portal.start_task(endpoint.run)
        served = Running(endpoint, FakeClaimHandler(), portal, task)
        try:
            stream = watch(served)
            began = time.monotonic()
            for _ in range(3):
                next(stream)
            assert time.monotonic() - began < 3
            stream.cancel()
        finally:
            served.stop()


def test_streams_beyond_the_bound_are_refused(watched: tuple[Running, FakeHealth]) -> None:
    served, _ = watched
    streams = [watch(served, (V1, V1ALPHA1)[i % 2]) for i in range(MAX_STREAMS)]
    for stream in streams:
        next(stream)
    with pytest.raises(grpc.RpcError) as refused:
        next(watch(served))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    for stream in streams:
        stream.cancel()
