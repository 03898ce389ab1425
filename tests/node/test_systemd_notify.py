"""The agent under systemd's notify protocol, against a real datagram socket standing in for systemd."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest

from mpsagent.node.systemd import SystemdNotifier
from mpsagent_testing.agents import AgentLauncher, start
from mpsagent_testing.kubelet.fake import FakeKubelet, wait_for
from mpsagent_testing.mps.daemon import daemon_pid
from mpsagent_testing.node import RESOURCE


class FakeSystemd:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.socket.bind(str(path))
        self.socket.settimeout(0.05)
        self.messages: list[str] = []

    def receive(self) -> list[str]:
        while True:
            try:
                self.messages.append(self.socket.recv(4096).decode())
            except TimeoutError:
                return self.messages

    def lines(self) -> list[str]:
        return [line for message in self.receive() for line in message.splitlines()]

    def wait_line(self, wanted: str, timeout: float = 10) -> int:
        """Index (in lines()) of the first line equal to, or starting with, `wanted`."""
        return (
            wait_for(
                lambda: next((i + 1 for i, line in enumerate(self.lines()) if line.startswith(wanted)), None),
                timeout,
                f"systemd to receive {wanted}",
            )
            - 1
        )


@pytest.fixture
def systemd(short_dir: Path):
    fake = FakeSystemd(short_dir / "notify.sock")
    yield fake
    fake.socket.close()


def test_ready_after_registration_status_lines_watchdog_and_stopping(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path, systemd: FakeSystemd
) -> None:
    agent = start(
        agents,
        kubelet,
        short_dir,
        env={"NOTIFY_SOCKET": str(systemd.path), "WATCHDOG_USEC": "400000"},
    )
    ready = systemd.wait_line("READY=1")
    lines = systemd.lines()
    assert lines[0] == "STATUS=starting"
    # Ready only once the kubelet has the resource.
    assert kubelet.plugins and kubelet.plugins[0].request.resource_name == RESOURCE
    assert systemd.wait_line("STATUS=serving nvidia.com/gpu (8/8 healthy, 0 grants, caps full)") >= ready - 1
    # The watchdog is fed every WATCHDOG_USEC / 2 while the loops run.
    first = len([line for line in systemd.lines() if line == "WATCHDOG=1"])
    time.sleep(1.0)
    assert len([line for line in systemd.lines() if line == "WATCHDOG=1"]) - first >= 3

    # The MPS daemon must not be able to speak for the agent.
    environ = Path(f"/proc/{daemon_pid(short_dir)}/environ").read_bytes().split(b"\0")
    assert not [v for v in environ if v.startswith((b"NOTIFY_SOCKET=", b"WATCHDOG_"))]

    # Status follows what happens: the kubelet restarts, the agent registers again.
    kubelet.restart()
    kubelet.wait_registered(RESOURCE)
    assert agent.stop(signal.SIGTERM) == 0
    lines = systemd.lines()
    assert "STOPPING=1" in lines and "STATUS=stopping on SIGTERM" in lines
    assert lines.count("READY=1") == 1


def test_a_watchdog_meant_for_another_process_is_not_fed(short_dir: Path, systemd: FakeSystemd) -> None:
    other = SystemdNotifier({"NOTIFY_SOCKET": str(systemd.path), "WATCHDOG_USEC": "1000", "WATCHDOG_PID": "1"})
    mine = SystemdNotifier(
        {"NOTIFY_SOCKET": str(systemd.path), "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": str(os.getpid())}
    )
    assert other.watchdog_interval_s is None
    assert mine.watchdog_interval_s == 0.5


def test_abstract_socket_names_and_no_socket_at_all(short_dir: Path) -> None:
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    name = f"mpsagent-test-{os.getpid()}"
    receiver.bind("\0" + name)
    receiver.settimeout(5)
    try:
        notifier = SystemdNotifier({"NOTIFY_SOCKET": "@" + name})
        notifier.status("hello")
        notifier.status("hello")  # unchanged: not sent again
        notifier.notify("READY=1")
        assert receiver.recv(100) == b"STATUS=hello"
        assert receiver.recv(100) == b"READY=1"
    finally:
        receiver.close()
    silent = SystemdNotifier({})
    assert not silent.enabled
    silent.notify("READY=1")  # nothing to send to, nothing raised


def test_systemd_gone_is_never_fatal(short_dir: Path) -> None:
    notifier = SystemdNotifier({"NOTIFY_SOCKET": str(short_dir / "missing.sock")})
    notifier.notify("READY=1")
    notifier.notify("WATCHDOG=1")
    notifier.close()
