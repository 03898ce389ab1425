"""The tests' grpcio fake kubelet with clocks: when each Register arrived, when its socket was listening again,
and when each ListAndWatch message reached the client."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import grpc

from mpsagent_testing.kubelet.fake import FakeKubelet, Plugin, wait_for

Devices = list[tuple[str, str, tuple[int, ...]]]
T = TypeVar("T")


def wait_until(condition: Callable[[], T | None], timeout_s: float, what: str) -> T:
    """The tests' `wait_for`, typed: the condition's first true value."""
    return cast(T, wait_for(condition, timeout_s, what))


@dataclass(frozen=True, slots=True)
class Arrival:
    ns: int
    """time.perf_counter_ns() in the bench process"""
    wall_ns: int
    """time.time_ns(), to compare with the agent's log timestamps"""


class TimedUpdates(list[Devices]):
    """A plugin's ListAndWatch messages, each with its arrival time (recorded before the message is visible)."""

    def __init__(self) -> None:
        super().__init__()
        self.arrivals: list[Arrival] = []

    def append(self, devices: Devices) -> None:
        self.arrivals.append(Arrival(time.perf_counter_ns(), time.time_ns()))
        super().append(devices)


@dataclass(frozen=True, slots=True)
class Registration:
    ns: int
    endpoint: str


class TimedKubelet(FakeKubelet):
    def __init__(self, socket_path: Any) -> None:
        super().__init__(socket_path)
        self.registrations: list[Registration] = []
        self.listening_ns = 0

    def start(self) -> TimedKubelet:
        super().start()
        self.listening_ns = time.perf_counter_ns()
        return self

    def Register(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.registrations.append(Registration(time.perf_counter_ns(), request.endpoint))
        return super().Register(request, context)

    def _watch(self, plugin: Plugin) -> None:
        # Runs in the stream's own thread before its first message is read, so no message is missed.
        plugin.updates = TimedUpdates()
        super()._watch(plugin)

    def registration_after(self, since_ns: int, endpoint_suffix: str, timeout_s: float) -> Registration:
        def found() -> Registration | None:
            return next(
                (r for r in self.registrations if r.ns >= since_ns and r.endpoint.endswith(endpoint_suffix)), None
            )

        return wait_until(found, timeout_s, f"Register from *{endpoint_suffix}")

    def plugin_for(self, endpoint_suffix: str, timeout_s: float) -> Plugin:
        """The latest registered plugin of this endpoint, once its first ListAndWatch message is in."""

        def found() -> Plugin | None:
            matching = [p for p in list(self.plugins) if p.request.endpoint.endswith(endpoint_suffix) and p.updates]
            return matching[-1] if matching else None

        return wait_until(found, timeout_s, f"the first ListAndWatch message of *{endpoint_suffix}")


def updates_of(plugin: Plugin) -> TimedUpdates:
    updates = plugin.updates
    if not isinstance(updates, TimedUpdates):
        raise TypeError("the plugin's stream is not timed")
    return updates


def wait_message(
    plugin: Plugin, start_index: int, condition: Callable[[Devices], bool], timeout_s: float, what: str
) -> tuple[int, Arrival]:
    """The first ListAndWatch message at or after `start_index` that meets `condition`: (its index, arrival)."""
    updates = updates_of(plugin)

    def found() -> tuple[int, Arrival] | None:
        for index in range(start_index, len(updates)):
            if condition(updates[index]):
                return index, updates.arrivals[index]
        return None

    return wait_until(found, timeout_s, what)


def all_health(value: str) -> Callable[[Devices], bool]:
    return lambda devices: bool(devices) and all(health == value for _, health, _ in devices)
