"""The DRA node service (`k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin`): the kubelet asks it to prepare a pod's
ResourceClaims before the pod's containers start, and to unprepare them once the pod is gone.

A thin layer: it bounds and checks what the kubelet sent, turns the claims into `ClaimRef`s for a `ClaimHandler`
(which decides, and reports each claim's outcome), and turns the outcomes into the reply. Per-claim failures are
the handler's to report, in the reply; a request outside the bounds is INVALID_ARGUMENT and reaches no handler; a
failure of the handler as a whole is UNAVAILABLE (an agent error: the node) or INTERNAL (anything else: a bug), and
the kubelet tries again.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Protocol, TypeVar

import betterproto2
import msgspec
from grpclib import GRPCError, Status
from grpclib.const import Handler

from mpsagent._proto.k8s.io.kubelet.pkg.apis.dra import v1 as pb
from mpsagent.base.errors import RequestError, shown
from mpsagent.base.logs import get_logger
from mpsagent.domain.claims import CLAIM_UID, CLAIM_UID_FORM, MAX_CLAIM_UID_CHARS, ClaimRef, PreparedDevice
from mpsagent.kubelet.wire import answering, unary_handler

log = get_logger(__name__)
_Request = TypeVar("_Request", bound=betterproto2.Message)

SERVICE = "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin"
"""The gRPC service, as the registration's supported versions name it (`v1.DRAPlugin`)."""
MAX_CLAIMS = 128
"""Claims in one request: a pod's claims (the API server allows 32 per pod), with room to spare."""
MAX_NAMESPACE_CHARS = 253
MAX_NAME_CHARS = 253
# A namespace and a claim's name are DNS names (a label, a subdomain); a UID is a UUID. The UID ends up in file
# names and CDI device names: never a `/`, never `.` or `..`.
_DNS_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")
_FIELDS = (
    ("namespace", MAX_NAMESPACE_CHARS, _DNS_NAME, "a DNS name"),
    ("name", MAX_NAME_CHARS, _DNS_NAME, "a DNS name"),
    ("uid", MAX_CLAIM_UID_CHARS, CLAIM_UID, CLAIM_UID_FORM),
)
CLAIM_WIRE_BYTES = 16
"""A claim's message beyond its three strings: tags and lengths."""
RECEIVE_LIMIT = 2 * MAX_CLAIMS * (MAX_NAMESPACE_CHARS + MAX_NAME_CHARS + MAX_CLAIM_UID_CHARS + CLAIM_WIRE_BYTES)
"""The largest request accepted: twice the largest within the bounds (about 150 KiB), refused before it is read
beyond its length prefix (grpclib would read any length whole)."""
NO_OUTCOME = "the agent gave no outcome for this claim (a bug: its log may tell more); the kubelet will ask again"


class PrepareOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """What preparing one claim came to: its devices, or why it failed (`error` non-empty: its devices are
    ignored)."""

    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""


class ClaimHandler(Protocol):
    """What prepares and unprepares claims. Each call gets distinct claims (by UID), checked against the bounds,
    and answers for each by UID; a claim it leaves out is answered as failed."""

    async def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, PrepareOutcome]:
        """Each claim's outcome, by UID."""
        ...

    async def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, str]:
        """Each claim's error text by UID; `""`: done (a claim that was never prepared, or is already unprepared,
        is done)."""
        ...


def claim_refs(claims: Sequence[pb.Claim | None]) -> list[ClaimRef]:
    """The request's claims, checked against the bounds, each UID once (in the order first given); raises
    RequestError naming what is wrong."""
    if len(claims) > MAX_CLAIMS:
        raise RequestError(f"{len(claims)} claims in one request; at most {MAX_CLAIMS} are accepted")
    refs: dict[str, ClaimRef] = {}
    for index, claim in enumerate(claims):
        if claim is None:  # betterproto2 reads a claim's tag with no content as None
            raise RequestError(f"claims[{index}] is not a claim")
        for field, limit, pattern, form in _FIELDS:
            value: str = getattr(claim, field)
            where = f"claims[{index}].{field}"
            if not value:
                raise RequestError(f"{where} is empty")
            if len(value) > limit:
                raise RequestError(f"{where} is {len(value)} characters long; at most {limit} are accepted")
            if not pattern.fullmatch(value):
                raise RequestError(f"{where} '{shown(value, 80)}' is not {form}")
        ref = ClaimRef(namespace=claim.namespace, name=claim.name, uid=claim.uid)
        known = refs.setdefault(ref.uid, ref)
        if known != ref:
            raise RequestError(f"claims[{index}]: UID {ref.uid} names both {known} and {ref}")
    return list(refs.values())


def device_message(device: PreparedDevice) -> pb.Device:
    return pb.Device(
        request_names=[device.request],
        pool_name=device.pool,
        device_name=device.device,
        cdi_device_ids=list(device.cdi_device_ids),
        share_id=device.share_id,
    )


class DraNodeService(pb.DraPluginBase):
    """The DRAPlugin servicer (grpclib's IServable, through the generated base)."""

    def __init__(self, handler: ClaimHandler) -> None:
        self._handler = handler

    async def node_prepare_resources(self, message: pb.NodePrepareResourcesRequest) -> pb.NodePrepareResourcesResponse:
        with self._answering("NodePrepareResources", "prepare", claims=len(message.claims)):
            claims = claim_refs(message.claims)
            outcomes = await self._handler.prepare(claims) if claims else {}
        replies: dict[str, pb.NodePrepareResourceResponse] = {}
        for claim in claims:
            outcome = outcomes.get(claim.uid)
            if outcome is None:
                log.error("claim not answered by the handler", rpc="NodePrepareResources", claim=str(claim))
                outcome = PrepareOutcome(error=NO_OUTCOME)
            if outcome.error:
                replies[claim.uid] = pb.NodePrepareResourceResponse(error=outcome.error)
            else:
                replies[claim.uid] = pb.NodePrepareResourceResponse(
                    devices=[device_message(d) for d in outcome.devices]
                )
        return pb.NodePrepareResourcesResponse(claims=replies)

    async def node_unprepare_resources(
        self, message: pb.NodeUnprepareResourcesRequest
    ) -> pb.NodeUnprepareResourcesResponse:
        with self._answering("NodeUnprepareResources", "unprepare", claims=len(message.claims)):
            claims = claim_refs(message.claims)
            errors = await self._handler.unprepare(claims) if claims else {}
        replies: dict[str, pb.NodeUnprepareResourceResponse] = {}
        for claim in claims:
            error = errors.get(claim.uid)
            if error is None:
                log.error("claim not answered by the handler", rpc="NodeUnprepareResources", claim=str(claim))
                error = NO_OUTCOME
            replies[claim.uid] = pb.NodeUnprepareResourceResponse(error=error)
        return pb.NodeUnprepareResourcesResponse(claims=replies)

    # --- the handler table (grpclib's IServable): the generated one, with requests received within RECEIVE_LIMIT --

    def __mapping__(self) -> dict[str, Handler]:
        return {
            f"/{SERVICE}/NodePrepareResources": self._unary(
                "NodePrepareResources",
                pb.NodePrepareResourcesRequest,
                pb.NodePrepareResourcesResponse,
                self.node_prepare_resources,
            ),
            f"/{SERVICE}/NodeUnprepareResources": self._unary(
                "NodeUnprepareResources",
                pb.NodeUnprepareResourcesRequest,
                pb.NodeUnprepareResourcesResponse,
                self.node_unprepare_resources,
            ),
        }

    def _unary(
        self,
        rpc: str,
        request_type: type[_Request],
        reply_type: type[betterproto2.Message],
        method: Callable[[_Request], Awaitable[betterproto2.Message]],
    ) -> Handler:
        def refuse(status: Status, reason: str) -> GRPCError:
            log.warning("request refused", rpc=rpc, reason=reason)
            return GRPCError(status, f"{rpc}: {reason}")

        return unary_handler(
            rpc, (request_type, reply_type), request_type.parse, method, limit=RECEIVE_LIMIT, refuse=refuse
        )

    def _answering(self, rpc: str, action: str, **context: object) -> AbstractContextManager[None]:
        """What goes wrong inside the RPC, as its gRPC status (`wire.answering`)."""
        return answering(log.bind(**context), rpc, action, refused=f"{rpc}: ", failed=f"{rpc}: ")
