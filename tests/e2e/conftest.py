"""The real node for the end-to-end tests: built once (cached; `scripts/test` builds it before pytest), brought up
for these tests and taken down after them, pass or fail. A failed test prints the tails of the kubelet's, the
agents' and its pods' logs, the kubelet's last lines of DRA and device-plugin work (its tail is mostly node status),
and the kubelet's goroutines inside a DRA or device-plugin call (one that waits on an agent shows there)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from mpsagent_testing.cluster import build, node, pods
from mpsagent_testing.cluster.layout import COMMANDS, LOGS, TOOLS


def _missing_tools() -> list[str]:
    missing = [tool for tool in ("etcd", "runc", "openssl") if shutil.which(tool) is None]
    built = all(build.path(name).is_file() for name in (*COMMANDS, *TOOLS))
    if not built and build.find_go(build.go_candidates()) is None:
        missing.append("Go 1.21+")  # only to build what the cache lacks
    if not Path("/bin/busybox").exists():
        missing.append("busybox-static")
    return missing


@pytest.fixture(scope="package")
def cluster() -> Iterator[str]:
    """The node's name, once it is Ready; taken down after the last real-node test, so that the rest of the suite
    runs without it. In CI a missing part fails the tests; elsewhere it skips them."""
    missing = _missing_tools()
    if missing or os.geteuid() != 0:
        why = f"missing {', '.join(missing)}" if missing else "not root"
        message = f"the real-node tests need root and scripts/install-system-deps.sh's packages: {why}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    build.ensure_binaries()  # nothing to do after `scripts/e2e-cluster build`
    was_up = bool(node.recorded())
    try:
        node.up()
    except node.OtherReleaseUp:
        raise  # someone else's node: left up
    except BaseException:
        node.down()
        raise
    yield node.node_name()
    if not was_up:
        pods.delete_all()
        node.down()


def _tail(path: Path, lines: int = 30, *, mentioning: tuple[str, ...] = ()) -> str:
    if not path.is_file():
        return f"(no {path})"
    found = path.read_text(errors="replace").splitlines()
    if mentioning:
        found = [line for line in found if any(word in line for word in mentioning)]
    return "\n".join(found[-lines:])


KUBELET_PLUGIN_WORDS = ("dra", "DRA", "claim", "Claim", "plugin", "Plugin", "Error syncing")
"""What the kubelet logs of its DRA and device-plugin work (and a pod's sync failing), at the node's verbosity."""


def _kubelet_calls_waiting() -> str:
    """The kubelet's goroutines inside a DRA or device-plugin call, from its pprof handler (or why they could not be
    read): a call the kubelet waits on for an agent's answer shows here and nowhere in its log."""
    dump = node.kubelet_goroutines()
    if dump.startswith("("):
        return dump
    stacks = [
        stack
        for stack in dump.split("\n\n")
        if any(part in stack.partition("\ncreated by ")[0] for part in ("/cm/dra", "/cm/devicemanager"))
    ]
    return "\n\n".join(stacks) if stacks else "(none)"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed or not node.recorded():
        return
    kubelet_log = LOGS / "kubelet.log"
    sections = [
        ("kubelet", _tail(kubelet_log)),
        ("kubelet's DRA and device-plugin lines", _tail(kubelet_log, 40, mentioning=KUBELET_PLUGIN_WORDS)),
    ]
    launcher = item.funcargs.get("agents")
    for agent in getattr(launcher, "started", []):
        sections.append((f"agent {agent.log_path.name}", _tail(agent.log_path)))
    try:
        sections.append(("kubelet's goroutines in DRA and device-plugin calls", _kubelet_calls_waiting()))
        listed = pods.kubectl.get("pods", "-A")["items"]
        for pod in listed:
            name, namespace = pod["metadata"]["name"], pod["metadata"]["namespace"]
            text = pods.kubectl.run("logs", name, "-n", namespace, "--all-containers", "--tail=30", check=False)
            sections.append((f"pod {namespace}/{name} ({pod['status'].get('phase')})", text))
    except Exception as exc:  # the report must not hide the test's own failure
        sections.append(("pods", f"could not list: {exc}"))
    for title, text in sections:
        report.sections.append((f"e2e: {title}", text))
