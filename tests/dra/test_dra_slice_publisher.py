"""The slice publisher against a fake API server behind lightkube's own client (a mock transport): it lists and
watches the driver's slices on the node and writes only the difference: nothing while nothing changes, the slice
again at once when someone deletes or edits it, a new wanted slice at the next pool generation within a second;
it backs off and says so once while the API server fails, and removes the slice on the way out (or says, once,
which slice it left and what removes it)."""

from __future__ import annotations

import copy
import itertools
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, cast

import anyio
import httpx2
import pytest
import structlog
from anyio.streams.memory import MemoryObjectSendStream
from lightkube.resources.resource_v1 import ResourceSlice
from structlog.testing import capture_logs

from mpsagent.domain.claims import DRA_DRIVER, NodeSlice
from mpsagent.dra import list_watch, slice_publisher, slice_writer
from mpsagent.dra.slice_object import CONTENT_ANNOTATION, resource_slice, slice_matches
from mpsagent.dra.slice_publisher import SlicePublisher
from mpsagent_testing.kube_api import NODE, NODE_OBJECT, NODE_SLICE, SLICE, SLICE_PATH, kube_api, status

NAME = SLICE.rsplit("/", 1)[1]
WRITES = {"POST", "PUT", "PATCH", "DELETE"}
CHANGED = NodeSlice(driver=DRA_DRIVER, node=NODE, pool=NODE, devices=NODE_SLICE.devices[:1])


def _canonical(value: str) -> str:
    """A capacity as the API server may write it back: the same amount in another form."""
    if value.isdigit() and int(value) and int(value) % (1 << 20) == 0:
        return f"{int(value) >> 20}Mi"
    return value


class FakeApiServer:
    """The API server as far as the publisher uses it: the Node, and the ResourceSlices listed, watched (each
    watch held open and fed every change after its resourceVersion), applied and deleted. Records each request;
    `someone_*` are changes of another client, seen only through the watch."""

    def __init__(self, *, opaque_versions: bool = False) -> None:
        self.slices: dict[str, dict[str, Any]] = {}
        self.version = 100
        self.opaque_versions = opaque_versions
        """resourceVersions that are no numbers (`rv-101`): opaque, as the API's conventions tell clients to treat
        them, so the publisher cannot order them."""
        self.held: list[tuple[int, bytes]] | None = None
        """While not None: the watch lags, each change kept here until `release_watch`."""
        self.before_delete: Callable[[str], None] | None = None
        self.requests: list[tuple[float, httpx2.Request]] = []
        self.history: list[tuple[int, bytes]] = []
        self.watches: list[MemoryObjectSendStream[bytes]] = []
        self.opened: list[MemoryObjectSendStream[bytes]] = []
        self.down = False
        self.hang = False
        self.refuse_writes: httpx2.Response | None = None

    # --- what the test sees

    def calls(self, method: str | None = None, *, watch: bool | None = None) -> list[httpx2.Request]:
        return [
            r
            for _, r in self.requests
            if (method is None or r.method == method)
            and (watch is None or (r.url.params.get("watch") == "true") == watch)
        ]

    def lists(self) -> int:
        return len([r for r in self.calls("GET", watch=False) if r.url.path == SLICE_PATH])

    def writes(self) -> list[str]:
        return [f"{r.method} {r.url.path}" for _, r in self.requests if r.method in WRITES]

    def generation(self) -> int:
        generation: int = self.slices[NAME]["spec"]["pool"]["generation"]
        return generation

    # --- another client's changes

    def resource_version(self, version: int | None = None) -> str:
        number = self.version if version is None else version
        return f"rv-{number}" if self.opaque_versions else str(number)

    def store(self, item: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        name = item["metadata"]["name"]
        kind = "MODIFIED" if name in self.slices else "ADDED"
        uid = self.slices[name]["metadata"]["uid"] if name in self.slices else f"uid-{name}-{self.version}"
        stored = copy.deepcopy(item)
        stored["metadata"] |= {"resourceVersion": self.resource_version(), "uid": uid}
        for device in stored["spec"].get("devices", []):
            for capacity in device.get("capacity", {}).values():
                capacity["value"] = _canonical(capacity["value"])
        self.slices[name] = stored
        self.emit(kind, stored)
        return stored

    def someone_deletes(self, name: str = NAME) -> None:
        self.version += 1
        gone = self.slices.pop(name)
        gone["metadata"]["resourceVersion"] = self.resource_version()
        self.emit("DELETED", gone)

    def someone_edits(self, edit: Callable[[dict[str, Any]], None], name: str = NAME) -> None:
        item = copy.deepcopy(self.slices[name])
        edit(item)
        self.store(item)

    def emit(self, kind: str, item: dict[str, Any], *, version: int | None = None) -> None:
        line = json.dumps({"type": kind, "object": item}).encode() + b"\n"
        if self.held is not None:
            self.held.append((self.version if version is None else version, line))
        else:
            self._send(self.version if version is None else version, line)

    def hold_watch(self) -> None:
        """The watch lags from now: the changes reach it only at `release_watch`."""
        self.held = []

    def release_watch(self, count: int | None = None) -> None:
        """The first `count` changes held reach the watch, in order; without `count`, all of them, and the watch
        keeps up from then on."""
        assert self.held is not None
        held = self.held
        self.held = held[count:] if count is not None else None
        for version, line in held[:count]:
            self._send(version, line)

    def _send(self, version: int, line: bytes) -> None:
        self.history.append((version, line))
        for watch in list(self.watches):
            try:
                watch.send_nowait(line)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                self.watches.remove(watch)

    def end_watches(self) -> None:
        for watch in self.watches:
            watch.close()
        self.watches.clear()

    def close(self) -> None:
        self.end_watches()
        for watch in self.opened:
            watch.close()

    # --- the transport's handler

    async def __call__(self, request: httpx2.Request) -> httpx2.Response:
        self.requests.append((anyio.current_time(), request))
        if self.hang:
            await anyio.sleep_forever()
        if self.down:
            raise httpx2.ConnectError("[Errno 111] Connection refused", request=request)
        path = request.url.path
        if path == f"/api/v1/nodes/{NODE}":
            return httpx2.Response(200, json=NODE_OBJECT)
        if path == SLICE_PATH and request.method == "GET":
            assert request.url.params["fieldSelector"] == f"spec.driver={DRA_DRIVER},spec.nodeName={NODE}"
            if request.url.params.get("watch") == "true":
                return self._watch(int(request.url.params["resourceVersion"].removeprefix("rv-")))
            listing = {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceSliceList",
                "metadata": {"resourceVersion": self.resource_version()},
                "items": list(self.slices.values()),
            }
            return httpx2.Response(200, json=listing)
        name = path.removeprefix(f"{SLICE_PATH}/")
        if request.method in WRITES and self.refuse_writes is not None:
            return self.refuse_writes
        if request.method == "PATCH":
            return httpx2.Response(200, json=self.store(json.loads(request.content)))
        if request.method == "DELETE" and self.before_delete is not None:
            self.before_delete(name)
        if request.method == "DELETE" and name in self.slices:
            self.someone_deletes(name)
            return httpx2.Response(200, json={"kind": "Status", "apiVersion": "v1", "status": "Success"})
        return status(404, f'resourceslices.resource.k8s.io "{name}" not found')

    def _watch(self, since: int) -> httpx2.Response:
        send, receive = anyio.create_memory_object_stream[bytes](1000)
        for version, line in self.history:
            if version > since:
                send.send_nowait(line)
        self.watches.append(send)
        self.opened.append(send)

        async def body() -> AsyncIterator[bytes]:
            async with receive:
                async for line in receive:
                    yield line

        return httpx2.Response(200, content=body(), headers={"Content-Type": "application/json"})


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    """Backoffs of tenths of a second: the tests see them grow without waiting a minute."""
    monkeypatch.setattr(slice_publisher, "PUBLISH_BACKOFF_S", (0.05, 0.2))
    monkeypatch.setattr(slice_writer, "REPAIR_BACKOFF_S", (0.3, 1.0))


async def until(condition: Callable[[], bool], *, within: float = 5.0) -> None:
    with anyio.fail_after(within):
        while not condition():
            await anyio.sleep(0.01)


@asynccontextmanager
async def running(server: FakeApiServer, wanted: NodeSlice | None = NODE_SLICE) -> AsyncIterator[SlicePublisher]:
    """A publisher over one client of `server`, wanting `wanted`, running for the block; cancelled after it
    (the way out included)."""
    kube = kube_api(server)
    publisher = SlicePublisher(kube, driver=DRA_DRIVER, node=NODE)
    if wanted is not None:
        publisher.want(wanted)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(publisher.run)
            try:
                yield publisher
            finally:
                tg.cancel_scope.cancel()
    finally:
        await kube.close()
        server.close()


def as_slice(document: dict[str, Any]) -> ResourceSlice:
    return cast(ResourceSlice, ResourceSlice.from_dict(document))


def published(node_slice: NodeSlice, generation: int) -> dict[str, Any]:
    return resource_slice(node_slice, generation=generation, node_uid="4f6e3d2c-node")


# --- quiet ---------------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_the_slice_is_published_once_and_an_idle_node_writes_nothing_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Today's claim server applied the slice every 60 s; the publisher writes once, then only reads: the watch,
    and a list each WATCH_SESSION_S (shortened here, so that the idle window sees several)."""
    monkeypatch.setattr(list_watch, "WATCH_SESSION_S", 0.2)
    server = FakeApiServer()
    async with running(server) as publisher:
        await until(lambda: publisher.published)
        assert server.writes() == [f"PATCH {SLICE}"]
        applied = server.calls("PATCH")[0]
        assert dict(applied.url.params) == {"fieldManager": "mpsagent", "force": "true"}
        assert json.loads(applied.content) == published(NODE_SLICE, 1)
        lists = server.lists()
        await anyio.sleep(1.0)  # the idle window: nothing is due in it
        assert server.writes() == [f"PATCH {SLICE}"]
        assert publisher.writes == 1
        assert server.lists() >= lists + 3
        assert publisher.published
        assert not publisher.publishing.failing


@pytest.mark.anyio
async def test_a_slice_an_earlier_run_published_is_kept_without_a_write_and_its_generation_too() -> None:
    server = FakeApiServer()
    server.store(published(NODE_SLICE, 7))
    with structlog.testing.capture_logs() as logs:
        async with running(server) as publisher:
            await until(lambda: publisher.published)
            await anyio.sleep(0.3)
            assert server.writes() == []
            said = [(e["event"], e["generation"]) for e in logs if "resource slice" in e["event"]]
            assert said == [("resource slice already published", 7)], "the start says the slice is there"
            server.someone_deletes()
            await until(lambda: NAME in server.slices)
            assert server.generation() == 7  # never below what this run found, though a lone slice may take any


@pytest.mark.anyio
async def test_a_wanted_slice_equal_to_the_last_writes_nothing() -> None:
    server = FakeApiServer()
    async with running(server) as publisher:
        await until(lambda: publisher.published)
        publisher.want(NodeSlice(driver=DRA_DRIVER, node=NODE, pool=NODE, devices=tuple(NODE_SLICE.devices)))
        assert publisher.published
        await anyio.sleep(0.3)
        assert publisher.writes == 1


# --- repairs -------------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_deleted_slice_is_re_created_within_5_s_at_the_same_generation() -> None:
    server = FakeApiServer()
    async with running(server) as publisher:
        await until(lambda: publisher.published)
        server.someone_deletes()
        await until(lambda: NAME in server.slices, within=5.0)
        assert server.slices[NAME]["spec"] == published(NODE_SLICE, 1)["spec"] | {"devices": _canonical_devices()}
        assert server.writes() == [f"PATCH {SLICE}", f"PATCH {SLICE}"]
        await until(lambda: publisher.published)


def _canonical_devices() -> list[dict[str, Any]]:
    devices: list[dict[str, Any]] = copy.deepcopy(published(NODE_SLICE, 1)["spec"]["devices"])
    for device in devices:
        for capacity in device["capacity"].values():
            capacity["value"] = _canonical(capacity["value"])
    return devices


def _lose_a_device(item: dict[str, Any]) -> None:
    item["spec"]["devices"] = item["spec"]["devices"][:1]


def _more_memory(item: dict[str, Any]) -> None:
    item["spec"]["devices"][0]["capacity"]["memory"]["value"] = "1Ti"


def _other_content(item: dict[str, Any]) -> None:
    item["metadata"]["annotations"][CONTENT_ANNOTATION] = "0" * 32


@pytest.mark.parametrize(
    ("edit", "generation"),
    [(_lose_a_device, 1), (_more_memory, 1), (_other_content, 2)],
    ids=["a device removed", "a capacity raised", "the content annotation changed"],
)
@pytest.mark.anyio
async def test_a_slice_edited_by_someone_else_is_applied_again(
    edit: Callable[[dict[str, Any]], None], generation: int
) -> None:
    """The spec as the agent writes it again; the generation moves only where the content digest says the slice
    shows something else (today's rule, `next_generation`)."""
    server = FakeApiServer()
    async with running(server) as publisher:
        await until(lambda: publisher.published)
        server.someone_edits(edit)
        await until(lambda: publisher.writes == 2, within=5.0)
        await until(lambda: publisher.published)
        restored = as_slice(server.slices[NAME])
        assert slice_matches(restored.to_dict(), resource_slice(NODE_SLICE, generation=generation, node_uid=""))
        assert server.generation() == generation


@pytest.mark.anyio
async def test_repairs_one_after_another_wait_longer_each_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fight with another writer stays slow: the first repair is at once, the next within REPAIR_QUIET_S waits
    REPAIR_BACKOFF_S (1 s, as shipped), then twice that. The bounds leave most of a second for a loaded machine."""
    monkeypatch.setattr(slice_writer, "REPAIR_BACKOFF_S", (1.0, 4.0))
    server = FakeApiServer()
    async with running(server) as publisher:
        await until(lambda: publisher.published)
        took = []
        for _ in range(3):
            deleted = anyio.current_time()
            server.someone_deletes()
            await until(lambda: NAME in server.slices, within=5.0)
            took.append(anyio.current_time() - deleted)
        assert took[0] < 0.8, took
        assert 0.98 <= took[1] < 1.8, took
        assert took[2] >= 1.98, took
        assert publisher.writes == 4


@pytest.mark.anyio
async def test_another_live_slice_of_the_pool_is_outranked_then_deleted() -> None:
    """The scheduler uses only the slices of a pool's highest generation: the node's slice goes above any other
    slice of the driver on the node, which is then deleted (the agent publishes one)."""
    server = FakeApiServer()
    stale = published(NODE_SLICE, 5)
    stale["metadata"]["name"] = "node-1-old"
    server.store(stale)
    async with running(server) as publisher:
        await until(lambda: publisher.published)
        assert server.writes() == [f"PATCH {SLICE}", f"DELETE {SLICE_PATH}/node-1-old"]
        assert server.generation() == 6
        assert list(server.slices) == [NAME]


@pytest.mark.anyio
async def test_a_slice_of_the_name_in_another_pool_is_deleted_then_created_in_the_node_s() -> None:
    """A slice's pool cannot be changed: the old one goes first, the new one a generation above it."""
    server = FakeApiServer()
    old = published(NODE_SLICE, 4)
    old["spec"]["pool"]["name"] = "old-pool"
    server.store(old)
    async with running(server) as publisher:
        await until(lambda: publisher.published)
        assert server.writes() == [f"DELETE {SLICE}", f"PATCH {SLICE}"]
        assert server.slices[NAME]["spec"]["pool"] == {"name": NODE, "generation": 5, "resourceSliceCount": 1}


@pytest.mark.anyio
async def test_the_watchs_late_word_of_the_agents_own_write_is_no_edit_and_someone_elses_still_is() -> None:
    """Issue 37: the watch's event of the agent's own write, arriving after the write's answer (here the write
    before the last, late), was taken for someone else's edit: the slice written again, `restored: changed behind
    the agent`. The server's resourceVersions are opaque here, as the API tells clients to treat them (nothing to
    order by): the publisher knows its own writes by the versions the server gave them."""
    server = FakeApiServer(opaque_versions=True)
    with capture_logs() as logs:
        async with running(server) as publisher:
            await until(lambda: publisher.published)
            server.hold_watch()
            for wanted in (CHANGED, NODE_SLICE):
                publisher.want(wanted)
                await until(lambda: publisher.published)
            server.release_watch(1)  # the event of CHANGED's write, after NODE_SLICE's was answered
            await anyio.sleep(0.3)  # the window in which the old publisher wrote again (at once)
            server.release_watch()
            assert server.writes() == [f"PATCH {SLICE}"] * 3
            server.someone_edits(_more_memory)
            await until(lambda: publisher.writes == 4)
            await until(lambda: publisher.published)
    whys = [e["why"] for e in logs if e["event"] == "resource slice published"]
    assert whys == ["new", "changed", "changed", "restored: changed behind the agent"]


@pytest.mark.anyio
async def test_the_watchs_late_word_of_the_agents_own_delete_is_no_deletion_behind_it() -> None:
    """The slice of the name in another pool deleted by the agent and its own applied: the DELETED event that
    comes after is the agent's own delete, not a slice deleted behind it (opaque resourceVersions, as above)."""
    server = FakeApiServer(opaque_versions=True)
    old = published(NODE_SLICE, 4)
    old["spec"]["pool"]["name"] = "old-pool"
    server.store(old)
    server.hold_watch()
    with capture_logs() as logs:
        async with running(server) as publisher:
            await until(lambda: publisher.published)
            server.release_watch(1)  # DELETED: the slice of the old pool
            await anyio.sleep(0.3)
            server.release_watch()
            assert server.writes() == [f"DELETE {SLICE}", f"PATCH {SLICE}"]
            server.someone_deletes()
            await until(lambda: NAME in server.slices)
    whys = [e["why"] for e in logs if e["event"] == "resource slice published"]
    assert whys == ["changed", "restored: deleted behind the agent"]


@pytest.mark.anyio
async def test_a_slice_the_agent_deleted_is_not_brought_back_by_the_watchs_late_word_of_it() -> None:
    """Another slice of the driver on the node, changed by someone just before the agent deletes it: the watch
    says that change after the agent's delete, which the old publisher took for a slice still there and deleted
    again (a wasted write, answered 404). Numbered resourceVersions: the change is newer than what the agent saw."""
    server = FakeApiServer()
    stale = published(NODE_SLICE, 5)
    stale["metadata"]["name"] = "node-1-old"
    server.store(stale)
    server.hold_watch()
    server.before_delete = lambda name: server.someone_edits(_lose_a_device, name)
    async with running(server) as publisher:
        await until(lambda: publisher.published)
        server.before_delete = None
        server.release_watch(2)  # the agent's slice applied, node-1-old changed
        await anyio.sleep(0.3)
        server.release_watch()
        assert server.writes() == [f"PATCH {SLICE}", f"DELETE {SLICE_PATH}/node-1-old"]


@pytest.mark.anyio
async def test_the_publisher_makes_no_client_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    server = FakeApiServer()
    async with running(server) as publisher:

        def no_client(*args: object, **kwargs: object) -> None:
            raise AssertionError("the publisher made a client")

        monkeypatch.setattr(httpx2.AsyncClient, "__init__", no_client)
        await until(lambda: publisher.published)
        server.someone_deletes()
        await until(lambda: NAME in server.slices)


# --- a new wanted slice --------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_new_wanted_slice_is_written_within_a_second_at_the_next_generation() -> None:
    server = FakeApiServer()
    async with running(server) as publisher:
        await until(lambda: publisher.published)
        publisher.want(CHANGED)
        assert not publisher.published
        await until(lambda: server.generation() == 2, within=1.0)
        await until(lambda: publisher.published)
        assert server.writes() == [f"PATCH {SLICE}", f"PATCH {SLICE}"]
        assert json.loads(server.calls("PATCH")[-1].content) == published(CHANGED, 2)
        server.someone_deletes()  # a repair of the new slice: no new generation
        await until(lambda: NAME in server.slices)
        assert server.generation() == 2


@pytest.mark.anyio
async def test_the_slice_wanted_before_the_publisher_runs_is_its_first_publish() -> None:
    server = FakeApiServer()
    async with running(server, wanted=None) as publisher:
        await anyio.sleep(0.2)
        assert server.writes() == []  # nothing wanted yet: nothing written
        publisher.want(NODE_SLICE)
        await until(lambda: publisher.published, within=1.0)
        assert server.generation() == 1


def test_a_slice_of_another_node_is_refused_with_what_to_do() -> None:
    publisher = SlicePublisher(kube_api(FakeApiServer()), driver=DRA_DRIVER, node=NODE)
    other = NodeSlice(driver=DRA_DRIVER, node="node-2", pool="node-2", devices=())
    with pytest.raises(ValueError, match="make one publisher per driver and node"):
        publisher.want(other)


# --- failures ------------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_an_api_server_that_does_not_answer_is_tried_again_with_backoff_and_reported_once() -> None:
    server = FakeApiServer()
    server.down = True
    with capture_logs() as logs:
        async with running(server) as publisher:
            await until(lambda: len(server.requests) >= 4)
            assert not publisher.published
            assert publisher.publishing.failing
            times = [at for at, _ in server.requests]
            gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
            assert min(gaps) >= 0.04  # no hot loop
            assert gaps[-1] > gaps[0]  # and the wait grows
            server.down = False
            await until(lambda: publisher.published)
    failed = [e for e in logs if e["event"] == "resource slice not published"]
    assert len(failed) == 1
    assert failed[0]["log_level"] == "error"
    assert failed[0]["reason"] == (
        f"listing the ResourceSlices of {DRA_DRIVER} on node {NODE}: [Errno 111] Connection refused"
    )
    assert [e["event"] for e in logs].count("resource slice published again") == 1


@pytest.mark.anyio
async def test_a_refused_write_is_tried_again_with_backoff_and_reported_once() -> None:
    server = FakeApiServer()
    server.refuse_writes = status(403, 'resourceslices.resource.k8s.io "node-1-mps-mpsagent-io" is forbidden')
    with capture_logs() as logs:
        async with running(server) as publisher:
            await until(lambda: publisher.writes >= 3)
            assert not publisher.published
            server.refuse_writes = None
            await until(lambda: publisher.published)
    failed = [e for e in logs if e["event"] == "resource slice not published"]
    assert len(failed) == 1
    assert failed[0]["reason"].endswith("is forbidden (HTTP 403)")
    assert failed[0]["hint"].startswith("check that the agent's service account may write resourceslices")


@pytest.mark.anyio
async def test_a_watch_that_fails_is_listed_and_watched_again_and_still_repairs() -> None:
    server = FakeApiServer()
    async with running(server) as publisher:
        await until(lambda: publisher.published)
        lists, watches = server.lists(), len(server.calls("GET", watch=True))
        expired = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 410, "message": "too old"}
        server.emit("ERROR", expired)
        await until(lambda: len(server.calls("GET", watch=True)) == watches + 1)
        assert server.lists() == lists + 1
        assert publisher.watching.failing
        server.someone_deletes()
        await until(lambda: NAME in server.slices)
        assert publisher.writes == 2


@pytest.mark.anyio
async def test_a_watch_the_server_ends_is_watched_again_from_the_last_change() -> None:
    server = FakeApiServer()
    async with running(server) as publisher:
        await until(lambda: publisher.published)
        watches = len(server.calls("GET", watch=True))
        server.end_watches()
        await until(lambda: len(server.calls("GET", watch=True)) == watches + 1)
        resumed = server.calls("GET", watch=True)[-1]
        assert resumed.url.params["resourceVersion"] == server.slices[NAME]["metadata"]["resourceVersion"]
        server.someone_deletes()
        await until(lambda: NAME in server.slices)
        assert publisher.writes == 2


@pytest.mark.anyio
async def test_what_the_watch_says_of_slices_not_ours_is_ignored() -> None:
    """The watch's objects are untrusted: another node's, another driver's or a nameless slice changes nothing,
    and an object that is no slice, or one without metadata, is a failed watch, listed again."""
    server = FakeApiServer()
    async with running(server) as publisher:
        await until(lambda: publisher.published)
        for part, key, value in (
            ("spec", "nodeName", "node-2"),
            ("spec", "driver", "gpu.example.com"),
            ("metadata", "name", ""),
        ):
            foreign = copy.deepcopy(server.slices[NAME])
            foreign[part][key] = value
            server.version += 1
            foreign["metadata"]["resourceVersion"] = str(server.version)
            server.emit("DELETED", foreign)
        for broken in ({"metadata": {"name": NAME}, "spec": "not a slice"}, {"spec": server.slices[NAME]["spec"]}):
            await relisted_after(server, broken)
        await anyio.sleep(0.2)
        assert publisher.writes == 1
        assert publisher.published


async def relisted_after(server: FakeApiServer, event: dict[str, Any]) -> None:
    lists = server.lists()
    server.emit("MODIFIED", event)
    await until(lambda: server.lists() == lists + 1)


# --- the way out ---------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_cancelled_it_deletes_the_slice() -> None:
    server = FakeApiServer()
    with capture_logs() as logs:
        async with running(server) as publisher:
            await until(lambda: publisher.published)
    assert server.slices == {}
    assert server.writes() == [f"PATCH {SLICE}", f"DELETE {SLICE}"]
    assert not publisher.published
    assert [(e["event"], e.get("slices")) for e in logs if "removed" in e["event"]] == [("resource slices removed", 1)]


@pytest.mark.anyio
async def test_cancelled_with_the_api_server_down_it_says_once_which_slice_it_left_and_what_removes_it() -> None:
    server = FakeApiServer()
    with capture_logs() as logs:
        async with running(server) as publisher:
            await until(lambda: publisher.published)
            server.down = True
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert [e["event"] for e in warnings] == ["resource slices not removed"]
    assert warnings[0]["slices"] == [NAME]
    assert warnings[0]["reason"].endswith("[Errno 111] Connection refused")
    assert warnings[0]["hint"] == (
        "the agent's next start on the node replaces it, the Node's deletion removes it (its ownerReference), or "
        f"remove it by hand: kubectl delete resourceslice {NAME}"
    )


@pytest.mark.anyio
async def test_cancelled_with_the_api_server_silent_it_gives_up_in_bounded_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(slice_writer, "REMOVE_TIMEOUT_S", 0.2)
    server = FakeApiServer()
    with capture_logs() as logs:
        with anyio.fail_after(2.0):
            async with running(server) as publisher:
                await until(lambda: publisher.published)
                server.hang = True
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert [(e["event"], e["slices"], e["reason"]) for e in warnings] == [
        ("resource slices not removed", [NAME], "no answer within 0.2 s")
    ]


# --- the comparison ------------------------------------------------------------------------------------------


def test_a_slice_matches_what_the_agent_writes_by_amount_and_not_by_fields_the_server_adds() -> None:
    desired = resource_slice(NODE_SLICE, generation=3, node_uid="")
    served = copy.deepcopy(desired)
    served["metadata"] |= {"resourceVersion": "9", "uid": "u", "managedFields": []}
    served["spec"]["devices"][0]["capacity"]["memory"]["requestPolicy"]["default"] = "1Gi"
    served["spec"]["devices"][0]["capacity"]["compute"]["value"] = "100000m"
    served["spec"]["devices"][0]["consumesCounters"] = []
    assert slice_matches(as_slice(served).to_dict(), desired)
    for path, value in [
        (("spec", "pool", "generation"), 2),
        (("spec", "devices", 0, "capacity", "compute", "value"), "99"),
        (("spec", "devices", 1, "attributes", "index", "int"), 7),
        (("spec", "devices", 0, "allowMultipleAllocations"), False),
    ]:
        changed = copy.deepcopy(served)
        where: Any = changed
        for step in path[:-1]:
            where = where[step]
        where[path[-1]] = value
        assert not slice_matches(as_slice(changed).to_dict(), desired), path
