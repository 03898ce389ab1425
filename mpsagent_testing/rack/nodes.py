"""The rack's nodes, which no kubelet runs: a Node object each, made Ready as a kubelet makes its node (the Ready
condition, room for pods) and kept so by a Lease renewed every RENEW_S, as a kubelet's heartbeat is, so that the
scheduler places pods there and the node lifecycle controller neither marks them unreachable nor taints them.
`close` deletes the Nodes and their Leases."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime

from mpsagent_testing.rack.rest import Api, Object

LEASES = "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases"
LEASE_DURATION_S = 40
RENEW_S = 10.0
"""A kubelet renews its lease every 10 s (a quarter of its 40 s duration)."""
CAPACITY = {"cpu": "64", "memory": "1Ti", "pods": "110"}
"""What each node offers beside its GPUs: more than the rack's pods ask (they ask nothing but their claims)."""
RACK_LABEL = "mpsagent.io/rack"
READY_TIMEOUT_S = 60.0


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _micro_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def ready(node: Object) -> bool:
    """The node's Ready condition is True and it carries no taint of the node lifecycle controller's."""
    conditions = node.get("status", {}).get("conditions", [])
    is_ready = any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
    taints = node.get("spec", {}).get("taints") or []
    return is_ready and not any(t["key"].startswith("node.kubernetes.io/") for t in taints)


class RackNodes:
    """Nodes named `names`, made and kept Ready until `close`."""

    def __init__(self, api: Api, names: list[str]) -> None:
        self.names = names
        self._api = api
        self._stopping = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self.renewals = 0
        self.failure: BaseException | None = None
        """What stopped the heartbeat, if something did."""

    def create(self) -> None:
        """Each Node, Ready, with its Lease; the heartbeat started. Returns before the node lifecycle controller
        has taken the not-ready taint off (`wait_ready`)."""
        for name in self.names:
            node = self._api.create("/api/v1/nodes", _node(name))
            self._api.patch(f"/api/v1/nodes/{name}/status", {"status": _status()})
            self._api.create(LEASES, _lease(name, node["metadata"]["uid"]))
        self._heartbeat = threading.Thread(target=self._beat, name="rack heartbeat", daemon=True)
        self._heartbeat.start()

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while True:
            listed = self._api.get(f"/api/v1/nodes?labelSelector={RACK_LABEL}")["items"]
            waiting = sorted(set(self.names) - {n["metadata"]["name"] for n in listed if ready(n)})
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"rack nodes not Ready (or still tainted) after {timeout:g} s: {waiting}")
            time.sleep(0.5)

    def _beat(self) -> None:
        try:
            while not self._stopping.wait(RENEW_S):
                for name in self.names:
                    self._api.patch(f"{LEASES}/{name}", {"spec": {"renewTime": _micro_now()}})
                    self.renewals += 1
        except BaseException as exc:
            self.failure = exc
            raise

    def close(self) -> None:
        """Stop the heartbeat; delete every Node and Lease of the rack (those of an earlier run too)."""
        self._stopping.set()
        if self._heartbeat is not None:
            self._heartbeat.join(RENEW_S + 30)
        delete_all(self._api)


def delete_all(api: Api) -> list[str]:
    """Delete every Node labelled as the rack's, and its Lease; their names."""
    names = [n["metadata"]["name"] for n in api.get(f"/api/v1/nodes?labelSelector={RACK_LABEL}")["items"]]
    for name in names:
        api.delete(f"/api/v1/nodes/{name}")
        api.delete(f"{LEASES}/{name}")
    return names


def _node(name: str) -> Object:
    labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", RACK_LABEL: "true"}
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}, "spec": {}}


def _status() -> Object:
    now = _now()
    conditions = [
        {
            "type": kind,
            "status": "False",
            "reason": f"KubeletHas{reason}",
            "lastHeartbeatTime": now,
            "lastTransitionTime": now,
        }
        for kind, reason in (
            ("MemoryPressure", "SufficientMemory"),
            ("DiskPressure", "NoDiskPressure"),
            ("PIDPressure", "SufficientPID"),
        )
    ]
    conditions.append(
        {
            "type": "Ready",
            "status": "True",
            "reason": "KubeletReady",
            "message": "the rack keeps it Ready",
            "lastHeartbeatTime": now,
            "lastTransitionTime": now,
        }
    )
    return {"capacity": CAPACITY, "allocatable": CAPACITY, "conditions": conditions}


def _lease(name: str, node_uid: str) -> Object:
    owner = {"apiVersion": "v1", "kind": "Node", "name": name, "uid": node_uid}
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": name, "namespace": "kube-node-lease", "ownerReferences": [owner]},
        "spec": {"holderIdentity": name, "leaseDurationSeconds": LEASE_DURATION_S, "renewTime": _micro_now()},
    }
