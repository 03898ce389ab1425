"""A rack on one machine: `Rack` brings N agents (`agents`) up against the node's API server and scheduler, each on a
kubelet-less node kept Ready (`nodes`), with the kubelet's DRA calls made for them (`kubelet`), the devices' use
checked at every change (`capacity`) and each agent's requests counted from the audit log (`audit`); pods of
random claims are submitted and deleted in waves (`submit`, `delete`, `settle`). Leaving it ends everything it
started, pass or fail: the pods and claims, the agents and their MPS daemons, the Nodes and Leases, the service
accounts and the namespace."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from mpsagent_testing.cluster import claims, kubectl
from mpsagent_testing.cluster.node import AUDITED_NAMESPACE
from mpsagent_testing.rack import nodes
from mpsagent_testing.rack.agents import GPUS, RackAgent, RackAgents, account, grant
from mpsagent_testing.rack.audit import AuditLog, Requests, check_audited
from mpsagent_testing.rack.capacity import CapacityWatch, allocated, offered
from mpsagent_testing.rack.kubelet import KubeletStandIn, Prepared
from mpsagent_testing.rack.nodes import RackNodes
from mpsagent_testing.rack.rest import Api, ApiError, Informer, Object
from mpsagent_testing.rack.workload import Size, Workload, unschedulable

NAMESPACE = AUDITED_NAMESPACE
NAMESPACE_GONE_S = 180.0
SLICES_TIMEOUT_S = 120.0
GRANT_SEEN_TIMEOUT_S = 10.0
SETTLE_TIMEOUT_S = 240.0
PROBLEMS_SHOWN = 10
"""An agent's last warnings and errors printed when the block fails."""
PODS = f"/api/v1/namespaces/{NAMESPACE}/pods"
CLAIMS = f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaims"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"


def node_name(index: int) -> str:
    return f"rack-{index:02d}"


@dataclass(frozen=True)
class Window:
    """What each agent did over a stretch of time: its requests as the API server recorded them, and its CPU and
    RSS."""

    seconds: float
    requests: dict[str, Requests]
    """By agent node name."""
    cpu_percent: dict[str, float]
    """Per cent of one core over the window, by node name."""
    rss_bytes: dict[str, int]
    """At the window's end."""


class Rack:
    """`size` agents on nodes `rack-00`…, each with `gpus` GPUs, up for the block it is used in."""

    def __init__(self, size: int, *, seed: int = 1, gpus: int = GPUS) -> None:
        self.size = size
        self.api = Api()
        self.names = [node_name(i) for i in range(size)]
        self.workload = Workload(NAMESPACE, seed=seed)
        self.audit = AuditLog()
        self._directory = Path(tempfile.mkdtemp(prefix="mpa-rack-", dir="/tmp"))
        self.nodes = RackNodes(self.api, self.names)
        self.agents = RackAgents(self.api, self._directory, self.names, gpus=gpus)
        self.capacity = CapacityWatch(self.api, NAMESPACE)
        self.kubelet: KubeletStandIn | None = None
        self.started_at: list[float] = []
        self.slice_seen: dict[str, list[tuple[float, Object]]] = {}
        """Each node's slice as the watch saw it change, with the time (`time.time`)."""
        self._seen_lock = threading.Lock()
        self._slices = Informer(
            self.api, SLICES, f"fieldSelector=spec.driver%3D{claims.DRIVER}", changed=self._slice_changed
        )

    # --- up and down -------------------------------------------------------------------------------------------

    def __enter__(self) -> Rack:
        check_audited()
        try:
            self._up()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        if error is not None:
            self._tell_agents_problems()
        self.close()

    def _tell_agents_problems(self) -> None:
        """Print each agent's last warnings and errors (its log goes with the rack's directory): the test's or the
        bench's output shows them beside the failure."""
        for agent in self.agents.agents:
            if agent.process is None:
                continue
            events = [e for e in agent.process.log_events() if e.get("level") in {"warning", "error", "critical"}]
            for event in events[-PROBLEMS_SHOWN:]:
                print(f"{agent.node}: {json.dumps(event)}", file=sys.stderr)

    def _up(self) -> None:
        self._clean()
        self.api.create(
            "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}
        )
        claims.apply_file(claims.DEVICE_CLASS_FILE)
        for index in range(self.size):
            account_object = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": account(index)}}
            self.api.create(f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts", account_object)
        # Pods are admitted once the namespace's default service account is made.
        kubectl.wait_for(lambda: self._exists(f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/default"), 30,
                         "the namespace's default service account")  # fmt: skip
        self.nodes.create()
        self.nodes.wait_ready()
        self._slices.start()
        self.capacity.start()
        self.started_at = self.agents.start()
        self.agents.wait_serving()
        sockets = {agent.node: agent.dra_socket for agent in self.agents.agents}
        self.kubelet = KubeletStandIn(self.api, NAMESPACE, sockets).start()

    def _exists(self, path: str) -> bool:
        try:
            self.api.get(path)
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def _clean(self) -> None:
        """Whatever a rack left on the API server (this one, or an earlier one that was killed): its nodes, and its
        namespace with the pods (deleted at once: no kubelet would confirm) and claims in it."""
        nodes.delete_all(self.api)
        if self._exists(f"/api/v1/namespaces/{NAMESPACE}"):
            self.api.delete(PODS, {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0})
            self.api.delete(f"/api/v1/namespaces/{NAMESPACE}")
        deadline = time.monotonic() + NAMESPACE_GONE_S
        while self._exists(f"/api/v1/namespaces/{NAMESPACE}"):
            if time.monotonic() > deadline:
                raise AssertionError(f"namespace {NAMESPACE} is still there {NAMESPACE_GONE_S:g} s after its deletion")
            time.sleep(0.5)

    def close(self) -> None:
        """End everything, each step whatever the one before did: the watches and the kubelet stand-in first (so
        that nothing reacts to the rest), the agents (each removes its slice and quits its MPS daemon), the nodes,
        the namespace, the DeviceClass, the agents' files."""
        steps = [
            self.capacity.stop,
            self._slices.stop,
            *([] if self.kubelet is None else [self.kubelet.stop]),
            self.agents.close,
            self.nodes.close,
            self._clean,
            lambda: kubectl.run("delete", "-f", str(claims.DEVICE_CLASS_FILE), "--ignore-not-found", check=False),
            lambda: shutil.rmtree(self._directory, ignore_errors=True),
        ]
        failures = []
        for step in steps:
            try:
                step()
            except Exception as exc:
                failures.append(exc)
        if failures:
            raise failures[0]

    # --- slices ------------------------------------------------------------------------------------------------

    def _slice_changed(self, kind: str, item: Object) -> None:
        with self._seen_lock:
            self.slice_seen.setdefault(item["spec"]["pool"]["name"], []).append((time.time(), item))

    def wait_slices(self, timeout: float = SLICES_TIMEOUT_S) -> dict[str, float]:
        """Each agent's time from its start to its slice seen at the API server."""
        deadline = time.monotonic() + timeout
        while True:
            with self._seen_lock:
                first = {node: seen[0][0] for node, seen in self.slice_seen.items() if seen}
            if set(self.names) <= first.keys():
                return {name: first[name] - self.started_at[i] for i, name in enumerate(self.names)}
            if time.monotonic() > deadline:
                raise AssertionError(f"no slice after {timeout:g} s from {sorted(set(self.names) - first.keys())}")
            time.sleep(0.1)

    def grant_followed(self, agent: RackAgent, gpu: int) -> float:
        """A device-plugin grant of one replica of `gpu` on `agent` (`agents.grant`); the seconds from the
        kubelet's Allocate to the agent's slice at the API server offering less of that GPU. The grant's client is
        counted on the device from then on."""
        device = (agent.node, f"gpu-{gpu}")
        with self._seen_lock:
            before = offered(self.slice_seen[agent.node][-1][1])[device]["memory"]
        sent = grant(agent, gpu)
        deadline = time.monotonic() + GRANT_SEEN_TIMEOUT_S
        while True:
            with self._seen_lock:
                seen = [(at, item) for at, item in self.slice_seen[agent.node] if at >= sent]
            for at, item in seen:
                if offered(item)[device]["memory"] < before:
                    self.capacity.other_clients[device] = self.capacity.other_clients.get(device, 0) + 1
                    return at - sent
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{agent.node}'s slice still offers {before} bytes of {device[1]} "
                    f"{GRANT_SEEN_TIMEOUT_S:g} s after a device-plugin grant there"
                )
            time.sleep(0.02)

    # --- pods --------------------------------------------------------------------------------------------------

    def submit(self, count: int, size: Size | None = None) -> list[str]:
        """`count` more pods with their claims (of `size`, or the workload's random sizes); their names."""
        made = []
        for _ in range(count):
            name, drawn = self.workload.next(size)
            self.api.create(CLAIMS, self.workload.claim(name, drawn))
            self.api.create(PODS, self.workload.pod(name))
            made.append(name)
        return made

    def delete(self, names: list[str]) -> None:
        """Delete the pods as a user does (the kubelet stand-in unprepares a placed pod's claim and finishes its
        deletion), and their claims."""
        for name in names:
            self.api.delete(f"{PODS}/{name}")
        for name in names:
            self.api.delete(f"{CLAIMS}/{name}")

    def allocated_device(self, claim: str) -> str:
        """The device (`pool/device`) the scheduler allocated the claim."""
        ((pool, device), _), *more = allocated(self.api.get(f"{CLAIMS}/{claim}"))
        assert not more, f"claim {claim} has {1 + len(more)} devices"
        return f"{pool}/{device}"

    def pods(self) -> dict[str, Object]:
        return {pod["metadata"]["name"]: pod for pod in self.api.get(PODS)["items"]}

    def settle(self, timeout: float = SETTLE_TIMEOUT_S) -> dict[str, Object]:
        """Wait until every pod is placed and its claim's prepare answered, or Pending with the scheduler's reason
        where its claim fits no device now (by the slices and the allocations), and every deleted pod and claim is
        gone (a deleted claim's capacity is free only then); the pods then. AssertionError naming the pods that are
        not, after `timeout`."""
        assert self.kubelet is not None
        deadline = time.monotonic() + timeout
        while True:
            self.check_watching()
            pods = self.pods()
            answered = self.kubelet.prepared()
            deleted = self.capacity.claims() - pods.keys()
            waiting = [name for name, pod in pods.items() if not self._settled(pod, answered)]
            if not waiting and not deleted and not self.kubelet.busy():
                return pods
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"not settled after {timeout:g} s: {len(waiting)} pods {waiting[:10]}, "
                    f"{len(deleted)} claims of deleted pods {sorted(deleted)[:10]}"
                )
            time.sleep(0.5)

    def check_watching(self) -> None:
        """AssertionError when one of the rack's own threads stopped: a watch (the checks and the prepares follow
        them) or the nodes' heartbeat."""
        parts = {"the slices' watch": self._slices.failure, "the capacity checks": self.capacity.failure(),
                 "the nodes' heartbeat": self.nodes.failure,
                 "the kubelet stand-in": None if self.kubelet is None else self.kubelet.failure()}  # fmt: skip
        for part, failure in parts.items():
            if failure is not None:
                raise AssertionError(f"{part} stopped: {failure!r}") from failure

    def _settled(self, pod: Object, answered: dict[str, Prepared]) -> bool:
        name = pod["metadata"]["name"]
        if "deletionTimestamp" in pod["metadata"]:
            return False
        if pod["spec"].get("nodeName"):
            return name in answered
        return unschedulable(pod) is not None and not self.capacity.fits_somewhere(
            *self.workload.sizes[name].consumes()
        )

    # --- what the agents did -----------------------------------------------------------------------------------

    def window(self, seconds: float = 0.0, during: Callable[[], object] | None = None) -> Window:
        """Watch the agents for `seconds` (idle), or while `during` runs, and count what each did."""
        usage = self.agents.usage()
        start = time.time()
        if during is not None:
            during()
        else:
            time.sleep(seconds)
        end = time.time()
        after = self.agents.usage()
        self.check_watching()
        time.sleep(1.0)  # the audit log's last lines of the window
        counted = self.audit.window(start, end)
        return Window(
            seconds=end - start,
            requests={a.node: counted.get(a.user, Requests()) for a in self.agents.agents},
            cpu_percent={
                a.node: 100 * (late.cpu_s - early.cpu_s) / (late.at - early.at)
                for a, early, late in zip(self.agents.agents, usage, after, strict=True)
            },
            rss_bytes={a.node: late.rss_bytes for a, late in zip(self.agents.agents, after, strict=True)},
        )
