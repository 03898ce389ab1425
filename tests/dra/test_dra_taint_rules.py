"""The administrators' DeviceTaintRules against a fake API server behind lightkube's own client (a mock transport):
the watcher lists them once and follows the watch, keeps those that taint devices of the node's slice (matched as the
scheduler matches them), says each as it comes and goes, never writes, and says why it does not watch them: an API
server that serves none (Kubernetes 1.36) is asked again rarely, a refused list once with what to grant."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx2
import pytest
from anyio.streams.memory import MemoryObjectSendStream
from structlog.testing import capture_logs

from mpsagent.base.backoff import Backoff
from mpsagent.domain.claims import DRA_DRIVER, TaintRule, TaintSelector
from mpsagent.dra import taint_rule_watch
from mpsagent.dra.taint_rule_watch import NOT_LISTED, NOT_SERVED, TaintRuleWatcher
from mpsagent_testing.kube_api import NODE, NODE_SLICE, kube_api, status

RULES_PATH = "/apis/resource.k8s.io/v1/devicetaintrules"


def rule(name: str, selector: dict[str, str] | None, *, key: str = "example.com/maintenance") -> dict[str, Any]:
    """A DeviceTaintRule as the API server returns it: `selector` its deviceSelector (None: none), a NoSchedule
    taint."""
    spec: dict[str, Any] = {
        "taint": {"key": key, "value": "planned", "effect": "NoSchedule", "timeAdded": "2026-12-07T10:00:00Z"}
    }
    if selector is not None:
        spec["deviceSelector"] = selector
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceTaintRule",
        "metadata": {"name": name, "uid": f"uid-{name}", "resourceVersion": "1"},
        "spec": spec,
    }


class FakeRulesServer:
    """The API server as far as the watcher asks it: the DeviceTaintRules listed and watched (each watch held open
    and fed what `emit` sends), or each request answered `refusal` while it is set. Records each request."""

    def __init__(self, *rules: dict[str, Any]) -> None:
        self.rules = {r["metadata"]["name"]: r for r in rules}
        self.refusal: httpx2.Response | None = None
        self.requests: list[httpx2.Request] = []
        self.watches: list[MemoryObjectSendStream[bytes]] = []

    def lists(self) -> int:
        return len([r for r in self.requests if r.url.params.get("watch") != "true"])

    def emit(self, kind: str, item: dict[str, Any]) -> None:
        if kind == "DELETED":
            self.rules.pop(item["metadata"]["name"])
        else:
            self.rules[item["metadata"]["name"]] = item
        for watch in self.watches:
            watch.send_nowait(json.dumps({"type": kind, "object": item}).encode() + b"\n")

    def close(self) -> None:
        for watch in self.watches:
            watch.close()

    async def __call__(self, request: httpx2.Request) -> httpx2.Response:
        self.requests.append(request)
        assert (request.method, request.url.path) == ("GET", RULES_PATH)
        if self.refusal is not None:
            return self.refusal
        if request.url.params.get("watch") == "true":
            send, receive = anyio.create_memory_object_stream[bytes](100)
            self.watches.append(send)

            async def body() -> AsyncIterator[bytes]:
                async with receive:
                    async for line in receive:
                        yield line

            return httpx2.Response(200, content=body(), headers={"Content-Type": "application/json"})
        listing = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceTaintRuleList",
            "metadata": {"resourceVersion": "100"},
            "items": list(self.rules.values()),
        }
        return httpx2.Response(200, json=listing)


async def until(condition: Callable[[], object], *, within: float = 5.0) -> None:
    with anyio.fail_after(within):
        while not condition():
            await anyio.sleep(0.01)


@asynccontextmanager
async def watching(server: FakeRulesServer) -> AsyncIterator[TaintRuleWatcher]:
    """A watcher of the node's slice over one client of `server`, running for the block."""
    kube = kube_api(server)
    watcher = TaintRuleWatcher(kube, NODE_SLICE, backoff=Backoff(0.05, 0.2))
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(watcher.run)
            try:
                yield watcher
            finally:
                tg.cancel_scope.cancel()
    finally:
        await kube.close()
        server.close()


def shown(watcher: TaintRuleWatcher) -> list[tuple[str, tuple[str, ...]]]:
    return [(each.name, devices) for each, devices in watcher.rules]


@pytest.mark.anyio
async def test_the_rules_on_the_node_s_devices_are_listed_once_then_followed_and_each_is_said() -> None:
    on_gpu_0 = {"driver": DRA_DRIVER, "pool": NODE, "device": "gpu-0"}
    server = FakeRulesServer(
        rule("gpu-0-maintenance", on_gpu_0),
        rule("every-device", {}),
        rule("other-driver", {"driver": "gpu.nvidia.com"}),
        rule("other-node", {"driver": DRA_DRIVER, "pool": "node-2"}),
        rule("no-selector", None),
        rule("no-such-device", {"device": "gpu-9"}),
    )
    with capture_logs() as logs:
        async with watching(server) as watcher:
            assert watcher.unseen == NOT_LISTED
            await until(lambda: watcher.unseen is None)
            assert shown(watcher) == [("every-device", ("gpu-0", "gpu-1")), ("gpu-0-maintenance", ("gpu-0",))]
            (maintenance, _) = watcher.rules[1]
            assert maintenance == TaintRule(
                name="gpu-0-maintenance",
                selector=TaintSelector(**on_gpu_0),
                key="example.com/maintenance",
                value="planned",
                effect="NoSchedule",
                added=1796637600.0,
            )
            await until(lambda: server.watches)

            server.emit("ADDED", rule("gpu-1-drain", {"pool": NODE, "device": "gpu-1"}))
            server.emit("MODIFIED", rule("gpu-0-maintenance", {"driver": DRA_DRIVER, "pool": "node-2"}))
            server.emit("DELETED", rule("every-device", {}))
            await until(lambda: shown(watcher) == [("gpu-1-drain", ("gpu-1",))])
            assert server.lists() == 1, "one list, then only the watch"
    said = [(e["event"], e["rule"]) for e in logs if "rule" in e]
    assert said == [
        ("device taint rule on the node's devices", "gpu-0-maintenance"),
        ("device taint rule on the node's devices", "every-device"),
        ("device taint rule on the node's devices", "gpu-1-drain"),
        ("device taint rule no longer on the node's devices", "gpu-0-maintenance"),
        ("device taint rule no longer on the node's devices", "every-device"),
    ]
    (first,) = [e for e in logs if e.get("rule") == "every-device" and "devices" in e]
    assert (first["devices"], first["taint"]) == (["gpu-0", "gpu-1"], "example.com/maintenance=planned:NoSchedule")


@pytest.mark.anyio
async def test_an_api_server_that_serves_none_is_said_so_once_and_asked_again_rarely(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = FakeRulesServer(rule("every-device", {}))
    server.refusal = status(404, "the server could not find the requested resource")
    with capture_logs() as logs:
        async with watching(server) as watcher:
            await until(lambda: watcher.unseen == NOT_SERVED)
            await anyio.sleep(0.3)
            assert len(server.requests) == 1, f"asked again after {taint_rule_watch.NOT_SERVED_RETRY_S} s, not sooner"
            assert watcher.rules == ()
            assert not watcher.listing.failing
        monkeypatch.setattr(taint_rule_watch, "NOT_SERVED_RETRY_S", 0.05)
        async with watching(server) as watcher:
            await until(lambda: len(server.requests) >= 4)
            server.refusal = None  # the control plane upgraded to 1.37
            await until(lambda: watcher.unseen is None)
            assert shown(watcher) == [("every-device", ("gpu-0", "gpu-1"))]
    events = [e["event"] for e in logs]
    assert events.count("device taint rules not served by the API server") == 2, "once per agent start"
    assert "device taint rules not listed" not in events


@pytest.mark.anyio
async def test_a_refused_list_is_said_once_with_what_to_grant_and_the_rules_are_watched_once_allowed() -> None:
    server = FakeRulesServer(rule("every-device", {}))
    forbidden = (
        'devicetaintrules.resource.k8s.io is forbidden: User "system:serviceaccount:mpsagent:mpsagent" cannot list'
    )
    server.refusal = status(403, forbidden)
    with capture_logs() as logs:
        async with watching(server) as watcher:
            await until(lambda: server.lists() >= 3)
            assert watcher.unseen == f"listing the DeviceTaintRules: {forbidden} (HTTP 403)"
            assert watcher.rules == ()
            server.refusal = None
            await until(lambda: watcher.unseen is None)
            assert shown(watcher) == [("every-device", ("gpu-0", "gpu-1"))]
    warned = [e for e in logs if e["event"] == "device taint rules not listed"]
    assert len(warned) == 1, "one warning for the episode, not one a try"
    assert warned[0]["hint"].startswith("check that the agent's service account may list and watch devicetaintrules")
    assert [e["event"] for e in logs].count("device taint rules listed again") == 1
