"""`scripts/e2e-cluster build|up|down|status|restart-kubelet`: the e2e node's command line (docs/e2e.md)."""

from __future__ import annotations

import argparse
import sys

from mpsagent_testing.cluster import build, node
from mpsagent_testing.cluster.images import ImageError
from mpsagent_testing.cluster.layout import KUBECONFIG, LOGS, RUN, STATE


def _status() -> int:
    processes = node.recorded()
    if not processes:
        print("down: no node is recorded")
        return 1
    for name, process in processes.items():
        print(f"{name:<24} pid {process.pid:<8} {'running' if process.alive() else 'GONE'}")
    ready = node.node_ready() if processes.get("kube-apiserver") and processes["kube-apiserver"].alive() else False
    print(f"node {node.node_name()}: {'Ready' if ready else 'not Ready'}")
    print(f"logs: {LOGS}")
    print(f"export KUBECONFIG={KUBECONFIG}")
    return 0 if ready else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="e2e-cluster",
        description="A real single-node Kubernetes on loopback for mpsagent's end-to-end tests (run as root).",
    )
    parser.add_argument(
        "command",
        choices=["build", "up", "down", "status", "restart-kubelet"],
        help="build: the binaries into the cache only; up: build if needed, start, wait for Ready; down: stop "
        f"everything it started and remove {STATE}, {RUN} and the kubelet's state; restart-kubelet: SIGTERM the "
        "kubelet and start it again",
    )
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            for part, seconds in build.ensure_binaries().items():
                print(f"built {part} in {seconds:.0f} s", file=sys.stderr)
            return 0
        if args.command == "up":
            build.ensure_binaries()
            try:
                took = node.up()
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
        return _status()
    except (build.BuildError, node.NodeError, ImageError, TimeoutError) as exc:
        print(f"e2e-cluster {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
