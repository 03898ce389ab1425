"""The Events the agent records on pods where it reaches the API server (`--dra on`): a control-socket hold it ended,
on the holder's pod, so that the pod's owner reads it in `kubectl describe pod`. The daemon supervisors report each
hold as they end it (`report`: never waits, at most QUEUED held back); one task looks each pod up by its UID among
the node's pods and records the Event through the DRA driver's API client. A failure is logged, never retried:
the agent's own log and metrics keep the hold."""

from __future__ import annotations

import anyio

from mpsagent.base.cgroups import short_id
from mpsagent.base.errors import KubeApiError
from mpsagent.base.logs import get_logger
from mpsagent.dra.api import KubeApi
from mpsagent.mps.daemon_status import HoldEnded

log = get_logger(__name__)

QUEUED = 32
"""Holds waiting to be told at most; more are dropped (and counted in the log): a tenant that reconnects in a loop
must not grow the agent."""
HOLD_REASON = "MpsControlSocketHeld"


def hold_message(ended: HoldEnded) -> str:
    holder = ended.holder
    what = "a connection that sent nothing" if holder.silent else "a control session left open"
    process = "a process" if holder.pid is None else f"PID {holder.pid}"
    container = "" if holder.container_id is None else f" in container {short_id(holder.container_id)}"
    return (
        f"{process}{container} held the node's MPS control socket (`{holder.socket}`: {what}) for "
        f"{ended.held_for_s:g} s, keeping every other control session out; the agent ended that connection. The MPS "
        "daemon and its other clients were not touched. Do not keep nvidia-cuda-mps-control open in a GPU pod"
    )


class PodEvents:
    def __init__(self, *, node: str) -> None:
        self._node = node
        self._send, self._receive = anyio.create_memory_object_stream[HoldEnded](max_buffer_size=QUEUED)
        self.dropped = 0

    def report(self, ended: HoldEnded) -> None:
        """A hold the agent ended, to be recorded on its pod (when it ran in one)."""
        if ended.holder.pod_uid is None:
            return
        try:
            self._send.send_nowait(ended)
        except anyio.WouldBlock:
            self.dropped += 1
            log.warning("pod event dropped: too many waiting", dropped=self.dropped, pod_uid=ended.holder.pod_uid)

    async def run(self, api: KubeApi) -> None:
        """Record each reported hold on its pod, until cancelled."""
        async for ended in self._receive:
            await self._record(api, ended)

    async def _record(self, api: KubeApi, ended: HoldEnded) -> None:
        holder = ended.holder
        assert holder.pod_uid is not None
        try:
            pod = await api.pod_of(node=self._node, uid=holder.pod_uid, container_id=holder.container_id or "")
            if pod is None:
                log.info("pod event not recorded: the pod is gone", pod_uid=holder.pod_uid)
                return
            await api.pod_event(pod, node=self._node, reason=HOLD_REASON, message=hold_message(ended))
        except KubeApiError as exc:
            log.warning("pod event not recorded", pod_uid=holder.pod_uid, reason=str(exc))
            return
        log.info("pod event recorded", pod=str(pod), container=pod.container, event_reason=HOLD_REASON)
