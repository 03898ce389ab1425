"""The kubelet's DRA calls for the rack's nodes, which have no kubelet: for each pod the scheduler binds to a rack
node, `NodePrepareResources` of its claim through that node's agent's DRA socket, as the kubelet calls it before it
starts a pod; for each such pod being deleted, `NodeUnprepareResources` and then the pod's deletion finished (grace
period 0), as the kubelet does once the pod's containers are gone. One worker per node, so that a node's calls come
in the order of its pods' changes, as from one kubelet. The pods stay Pending (no container runs); what each
prepare answered is kept (`outcomes`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc

from mpsagent_testing.kubelet.stubs import dra_grpc, dra_pb2
from mpsagent_testing.rack.rest import Api, Informer, Object

CALL_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Prepared:
    """What the agent answered the prepare of one pod's claim: the devices (`pool/device`) or its refusal."""

    pod: str
    node: str
    claim: str
    devices: tuple[str, ...]
    error: str
    seconds: float
    """The call's round trip."""


class KubeletStandIn:
    """Prepares and unprepares the claims of the pods of `namespace` on the nodes of `sockets` (node name → the
    agent's DRA socket), until `stop`."""

    def __init__(self, api: Api, namespace: str, sockets: dict[str, Path]) -> None:
        self._api = api
        self._namespace = namespace
        self._channels = {node: grpc.insecure_channel(f"unix://{path}") for node, path in sockets.items()}
        self._stubs = {node: dra_grpc.DRAPluginStub(channel) for node, channel in self._channels.items()}
        self._workers = {node: ThreadPoolExecutor(1, thread_name_prefix=f"kubelet {node}") for node in sockets}
        self._lock = threading.Lock()
        self._claims: dict[str, dra_pb2.Claim] = {}
        """The claim each prepared pod (by UID) had prepared."""
        self._handled: set[tuple[str, str]] = set()
        self._pending: list[Future[None]] = []
        self.outcomes: list[Prepared] = []
        self.unprepared = 0
        self.failures: list[str] = []
        """Calls that failed outright (not a refusal the agent answered)."""
        self._pods = Informer(api, f"/api/v1/namespaces/{namespace}/pods", changed=self._changed)

    def start(self) -> KubeletStandIn:
        self._pods.start()
        return self

    def failure(self) -> BaseException | None:
        """What ended its watch of the pods, if something did."""
        return self._pods.failure

    def busy(self) -> bool:
        """Some call is still queued or running."""
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()]
            return bool(self._pending)

    def prepared(self) -> dict[str, Prepared]:
        """The last outcome of each pod's prepare, by pod name."""
        with self._lock:
            return {outcome.pod: outcome for outcome in self.outcomes}

    def _changed(self, kind: str, pod: Object) -> None:
        node = pod["spec"].get("nodeName")
        if node not in self._workers:
            return
        uid = pod["metadata"]["uid"]
        ending = kind == "DELETED" or "deletionTimestamp" in pod["metadata"]
        step = ("end", uid) if ending else ("prepare", uid)
        with self._lock:
            if step in self._handled or (not ending and ("end", uid) in self._handled):
                return
            self._handled.add(step)
            call = self._end if ending else self._prepare
            self._pending.append(self._workers[node].submit(self._guarded, call, node, pod, kind))

    def _guarded(self, call: Callable[[str, Object, str], None], node: str, pod: Object, kind: str) -> None:
        try:
            call(node, pod, kind)
        except Exception as exc:
            with self._lock:
                self.failures.append(f"{pod['metadata']['name']} on {node}: {exc}")

    def _prepare(self, node: str, pod: Object, kind: str) -> None:
        (reference,) = pod["spec"]["resourceClaims"]
        name = reference["resourceClaimName"]
        claim_object = self._api.get(f"/apis/resource.k8s.io/v1/namespaces/{self._namespace}/resourceclaims/{name}")
        claim = dra_pb2.Claim(namespace=self._namespace, name=name, uid=claim_object["metadata"]["uid"])
        began = time.perf_counter()
        answer = self._stubs[node].NodePrepareResources(
            dra_pb2.NodePrepareResourcesRequest(claims=[claim]), timeout=CALL_TIMEOUT_S
        )
        seconds = time.perf_counter() - began
        result = answer.claims[claim.uid]
        outcome = Prepared(
            pod=pod["metadata"]["name"],
            node=node,
            claim=name,
            devices=tuple(f"{d.pool_name}/{d.device_name}" for d in result.devices),
            error=result.error,
            seconds=seconds,
        )
        with self._lock:
            self._claims[pod["metadata"]["uid"]] = claim
            self.outcomes.append(outcome)

    def _end(self, node: str, pod: Object, kind: str) -> None:
        uid = pod["metadata"]["uid"]
        with self._lock:
            claim = self._claims.pop(uid, None)
        if claim is not None:
            answer = self._stubs[node].NodeUnprepareResources(
                dra_pb2.NodeUnprepareResourcesRequest(claims=[claim]), timeout=CALL_TIMEOUT_S
            )
            error = answer.claims[claim.uid].error
            if error:
                raise RuntimeError(f"unprepare of {claim.name} refused: {error}")
            with self._lock:
                self.unprepared += 1
        if kind != "DELETED":
            name = pod["metadata"]["name"]
            finish = {
                "kind": "DeleteOptions",
                "apiVersion": "v1",
                "gracePeriodSeconds": 0,
                "preconditions": {"uid": uid},
            }
            self._api.delete(f"/api/v1/namespaces/{self._namespace}/pods/{name}", finish)

    def stop(self) -> None:
        self._pods.stop()
        for worker in self._workers.values():
            worker.shutdown(wait=True, cancel_futures=True)
        for channel in self._channels.values():
            channel.close()
