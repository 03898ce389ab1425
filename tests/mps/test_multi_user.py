"""`sharing.mps.multiUser`: one MPS server for every user (`-M`) where the control binary offers it. The Debian
535 binary has no `-M`; a thin wrapper around it plays a binary that has one (its `-h` lists
`--multiuser-server`; it records the arguments it is started with and strips `-M` before exec'ing the real one)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mpsagent_testing.agents import AgentLauncher, serve, start, status
from mpsagent_testing.kubelet.fake import FakeKubelet, wait_for
from mpsagent_testing.metrics import value
from mpsagent_testing.mps.daemon import REAL_BIN, daemon_pid
from mpsagent_testing.node import RESOURCE, config
from mpsagent_testing.processes import alive
from mpsagent_testing.repo import EXAMPLES, ROOT

WITHOUT_MULTI_USER = "mps daemon without a multi-user server: pods of different users take turns on its GPUs"
ADOPTED_OTHER_MODE = "adopted mps daemon keeps its user mode, which differs from the configuration"


def multi_user_binary(directory: Path) -> tuple[Path, Path]:
    """The wrapper and the file where it records the arguments of every daemon start."""
    directory.mkdir(exist_ok=True)
    wrapper, record = directory / "nvidia-cuda-mps-control", directory / "started-with"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'case "${{1:-}}" in -h|--help) {REAL_BIN} -h; echo "  -M, --multiuser-server   one server for all users";'
        " exit 0 ;; esac\n"
        f'[ "$#" -gt 0 ] && echo "$*" >> {record}\n'
        'for arg do shift; [ "$arg" = -M ] || set -- "$@" "$arg"; done\n'
        f'exec {REAL_BIN} "$@"\n'
    )
    wrapper.chmod(0o755)
    return wrapper, record


def with_multi_user(value: str) -> str:
    return config().replace("    resources:", f"    multiUser: {value}\n    resources:")


def daemon_state(short_dir: Path) -> dict:
    return json.loads((short_dir / "mps" / "nvidia.com" / "gpu" / "daemon.json").read_text())


def status_daemon(short_dir: Path) -> dict:
    path = short_dir / "mps" / "status.json"
    return wait_for(lambda: path.exists() and json.loads(path.read_text())["resources"][0]["daemon"], 5, "status")


def status_text(short_dir: Path) -> str:
    printed = status(short_dir)
    assert printed.returncode == 0, printed.stderr
    return printed.stdout


def events(agent, name: str) -> list[dict[str, object]]:
    return [e for e in agent.log_events() if e.get("event") == name]


def test_auto_uses_the_multi_user_server_where_the_binary_offers_it(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    wrapper, record = multi_user_binary(short_dir / "bin")
    agent, base = serve(agents, kubelet, short_dir, "--mps-control-bin", str(wrapper))
    kubelet.wait_registered(RESOURCE)
    assert record.read_text().splitlines() == ["-f -M"]
    assert daemon_state(short_dir)["multiUser"] is True
    assert status_daemon(short_dir)["multiUser"] is True
    assert "one server for every user (-M)" in status_text(short_dir)
    wait_for(lambda: value(base, "mpsagent_daemon_multi_user", resource=RESOURCE) == 1, 5, "the gauge")
    assert agent.wait_log("mps daemon started")["multi_user"] is True
    assert events(agent, WITHOUT_MULTI_USER) == []


def test_auto_without_the_option_runs_one_server_per_user_and_says_so_once(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    agent, base = serve(agents, kubelet, short_dir)
    kubelet.wait_registered(RESOURCE)
    assert daemon_state(short_dir)["multiUser"] is False
    assert status_daemon(short_dir)["multiUser"] is False
    assert "one server per user" in status_text(short_dir)
    wait_for(lambda: value(base, "mpsagent_daemon_multi_user", resource=RESOURCE) == 0, 5, "the gauge")
    (warning,) = events(agent, WITHOUT_MULTI_USER)
    assert warning["level"] == "warning"
    assert "--multiuser-server" in str(warning["hint"])


def test_false_never_passes_the_option(agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path) -> None:
    wrapper, record = multi_user_binary(short_dir / "bin")
    agent = start(agents, kubelet, short_dir, "--mps-control-bin", str(wrapper), text=with_multi_user("false"))
    kubelet.wait_registered(RESOURCE)
    assert record.read_text().splitlines() == ["-f"]
    assert status_daemon(short_dir)["multiUser"] is False
    assert events(agent, WITHOUT_MULTI_USER) == []  # asked for: no warning


def test_true_with_a_binary_without_the_option_is_refused(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    agent = start(agents, kubelet, short_dir, text=with_multi_user("true"))
    assert agent.process.wait(30) == 2
    assert "mpsagent: error: sharing.mps.multiUser: is true, but" in agent.log()
    assert "does not list --multiuser-server" in agent.log()
    assert "Traceback" not in agent.log()
    assert kubelet.plugins == []


def test_an_adopted_daemon_keeps_its_mode_and_the_agent_says_it_differs(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    wrapper, _ = multi_user_binary(short_dir / "bin")
    first = start(agents, kubelet, short_dir, "--mps-control-bin", str(wrapper))
    kubelet.wait_registered(RESOURCE)
    pid = daemon_pid(short_dir)
    first.stop(signal.SIGKILL)
    again = start(agents, kubelet, short_dir, "--mps-control-bin", str(wrapper), text=with_multi_user("false"))
    kubelet.wait_registered(RESOURCE, count=2)
    assert again.wait_log("mps daemon adopted")["multi_user"] is True
    warning = again.wait_log(ADOPTED_OTHER_MODE)
    assert (warning["daemon_multi_user"], warning["configured_multi_user"]) == (True, False)
    assert daemon_pid(short_dir) == pid and alive(pid)
    assert daemon_state(short_dir)["multiUser"] is True
    wait_for(lambda: status_daemon(short_dir)["multiUser"] is True, 5, "the status to show the daemon's mode")


def once(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mpsagent", "--once", "--node-snapshot", str(EXAMPLES / "node-h100x8.yaml"), *args],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
        check=False,
    )


@pytest.mark.parametrize(
    ("setting", "wrapped", "argv_tail", "server"),
    [("auto", True, ["-f", "-M"], True), ("auto", False, ["-f"], False), ("false", True, ["-f"], False)],
)
def test_once_shows_the_user_mode(
    tmp_path: Path, setting: str, wrapped: bool, argv_tail: list[str], server: bool
) -> None:
    binary = multi_user_binary(tmp_path / "bin")[0] if wrapped else Path(str(REAL_BIN))
    cfg = tmp_path / "config.yaml"
    cfg.write_text(with_multi_user(setting))
    result = once("--config-file", str(cfg), "--mps-control-bin", str(binary), "--output", "json")
    assert result.returncode == 0, result.stderr
    (resource,) = json.loads(result.stdout)["resources"]
    assert resource["daemonStart"]["argv"] == [str(binary), *argv_tail]
    assert resource["multiUser"]["setting"] == setting
    assert resource["multiUser"]["offered"] is wrapped
    assert resource["multiUser"]["server"] is server
    text = once("--config-file", str(cfg), "--mps-control-bin", str(binary)).stdout
    expected = "one MPS server for every user (-M)" if server else "one MPS server per user: pods of different users"
    assert f"  users: {expected}" in text
    assert f"(sharing.mps.multiUser: {setting})" in text


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("true", "sharing.mps.multiUser: is true, but"),
        ("maybe", "sharing.mps.multiUser: `maybe` is not supported; use one of: auto, true, false"),
    ],
)
def test_a_multi_user_setting_that_cannot_hold_exits_2(tmp_path: Path, value: str, message: str) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(with_multi_user(value))
    result = once("--config-file", str(cfg), "--mps-control-bin", str(REAL_BIN))
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
