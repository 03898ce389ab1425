"""`scripts/e2e-cluster build|up|down|status|restart-kubelet|test`: the e2e node's command line (docs/e2e.md), for the
Kubernetes release `MPSAGENT_E2E_KUBERNETES` names (layout.KUBERNETES_VERSIONS; the first when unset)."""

from __future__ import annotations

import argparse
import os
import sys

from mpsagent_testing.cluster import build, node
from mpsagent_testing.cluster.images import ImageError
from mpsagent_testing.cluster.layout import (
    KUBECONFIG,
    KUBERNETES_VERSION,
    KUBERNETES_VERSIONS,
    LOGS,
    RUN,
    STATE,
    VERSION_VARIABLE,
)
from mpsagent_testing.repo import ROOT

TEST_PYTHON = ROOT / ".venv" / "bin" / "python"
"""The test environment `scripts/test` makes, which `test` runs pytest in."""


def _status() -> int:
    processes = node.recorded()
    if not processes:
        print("down: no node is recorded")
        return 1
    for name, process in processes.items():
        print(f"{name:<24} pid {process.pid:<8} {'running' if process.alive() else 'GONE'}")
    ready = node.node_ready() if processes.get("kube-apiserver") and processes["kube-apiserver"].alive() else False
    print(f"node {node.node_name()}: {'Ready' if ready else 'not Ready'}, Kubernetes {node.running_version()}")
    print(f"logs: {LOGS}")
    print(f"export KUBECONFIG={KUBECONFIG}")
    return 0 if ready else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="e2e-cluster",
        description="A real single-node Kubernetes on loopback for mpsagent's end-to-end tests (run as root).",
        epilog=f"Kubernetes {KUBERNETES_VERSION}: {VERSION_VARIABLE} chooses the release, one of "
        f"{', '.join(KUBERNETES_VERSIONS)} (the first when unset).",
    )
    parser.add_argument(
        "command",
        choices=["build", "up", "down", "status", "restart-kubelet", "test"],
        help="build: the binaries into the cache only; up: build if needed, start, wait for Ready; down: stop "
        f"everything it started and remove {STATE}, {RUN} and the kubelet's state; restart-kubelet: SIGTERM the "
        "kubelet and start it again; test: build if needed, then the e2e tests (pytest tests/e2e in .venv, with "
        "the arguments that follow)",
    )
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.pytest_args and args.command != "test":
        parser.error(f"{args.command} takes no arguments: {' '.join(args.pytest_args)}")
    try:
        if args.command == "build":
            for part, seconds in build.ensure_binaries().items():
                print(f"built {part} in {seconds:.0f} s", file=sys.stderr)
            return 0
        if args.command == "up":
            build.ensure_binaries()
            try:
                took = node.up()
            except node.OtherReleaseUp:
                raise
            except BaseException:
                print("e2e-cluster: up failed; taking the node down again", file=sys.stderr)
                for line in node.down():
                    print(f"e2e-cluster: {line}", file=sys.stderr)
                raise
            if took:
                print(f"e2e-cluster: node {node.node_name()} Ready in {sum(took.values()):.1f} s", file=sys.stderr)
            print(f"export KUBECONFIG={KUBECONFIG}")
            return 0
        if args.command == "down":
            for line in node.down():
                print(line)
            return 0
        if args.command == "restart-kubelet":
            node.restart_kubelet()
            return 0
        if args.command == "test":
            # Built first: the tests build what is missing too, but a cold build runs past a test's timeout.
            build.ensure_binaries()
            if not TEST_PYTHON.is_file():
                print(f"e2e-cluster test: {TEST_PYTHON} is missing: ./scripts/test makes it", file=sys.stderr)
                return 1
            python = str(TEST_PYTHON)
            os.execv(python, [python, "-m", "pytest", str(ROOT / "tests" / "e2e"), *args.pytest_args])
        return _status()
    except (build.BuildError, node.NodeError, ImageError, TimeoutError) as exc:
        print(f"e2e-cluster {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
