"""The wire of the kubelet-facing gRPC services (the device plugin's and the DRA driver's): their sockets, served
owner-only with bounded flow-control windows (`bounded_server`, `start_owner_only`), requests received with a
size limit, which grpclib 0.4 has none of (`receive_request` reads the message's length prefix first and refuses a
message longer than the service's limit before its body is read; `RequestWire` is the one adapter below grpclib's
public surface that this needs), and the one mapping of what goes wrong inside an RPC to its gRPC status
(`answering`)."""

from __future__ import annotations

import os
import struct
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol, TypeVar

from grpclib import GRPCError, Status
from grpclib.config import Configuration
from grpclib.const import Cardinality, Handler
from grpclib.server import Server, Stream
from structlog.typing import FilteringBoundLogger

from mpsagent.base.errors import MpsAgentError, RequestError

MESSAGE_PREFIX = struct.Struct(">?I")
"""gRPC's length prefix: a compressed flag and the message length (big-endian)."""


OWNER_ONLY_UMASK = 0o177
_Request = TypeVar("_Request")
_Reply = TypeVar("_Reply")
Refuse = Callable[[Status, str], GRPCError]
"""How a service refuses a request: the error to raise for a status and a reason (it adds its prefix, logs and
counts)."""


@contextmanager
def answering(
    log: FilteringBoundLogger, rpc: str, action: str, *, refused: str = "", failed: str = ""
) -> Iterator[None]:
    """Turn what goes wrong inside an RPC into its gRPC status, the same for every kubelet-facing service: a request
    the agent refuses (RequestError, a grant or claim the node's accounting refuses included) is INVALID_ARGUMENT with
    the reason, a failure of the node (an agent error: the daemon, a file) UNAVAILABLE with its message, anything
    else a bug: INTERNAL with a short message, and the traceback in the log. `refused` and `failed` go before the
    message of each (`nvidia.com/gpu: `); `log` carries the request's context."""
    try:
        yield
    except RequestError as exc:
        log.warning(f"{action} refused", reason=str(exc))
        raise GRPCError(Status.INVALID_ARGUMENT, f"{refused}{exc}") from exc
    except MpsAgentError as exc:
        log.error(f"{action} failed", reason=str(exc))  # noqa: TRY400 (an agent error: no traceback)
        raise GRPCError(Status.UNAVAILABLE, f"{failed}{exc}") from exc
    except Exception as exc:
        log.exception(f"{action} failed unexpectedly")
        raise GRPCError(Status.INTERNAL, f"internal error in {rpc}; the mpsagent log has the details") from exc


class Servable(Protocol):
    """A gRPC service as grpclib serves it: its handler table (grpclib's own protocol is private)."""

    def __mapping__(self) -> Mapping[str, Handler]: ...


def bounded_server(servables: Sequence[Servable], window: int) -> Server:
    """A server whose clients may send at most `window` bytes (per stream and per connection) ahead of what it has
    read (grpclib's default is 4 MiB): no more than the largest request, which the services read before they let
    more through."""
    return Server(
        list(servables), config=Configuration(http2_connection_window_size=window, http2_stream_window_size=window)
    )


async def start_owner_only(server: Server, path: Path) -> None:
    """Serve on the socket file `path`, which only its owner may connect to from its first moment: the kubelet runs
    as root, and nobody else may allocate devices or prepare claims. Raises OSError."""
    old_umask = os.umask(OWNER_ONLY_UMASK)
    try:
        await server.start(path=str(path))
    finally:
        os.umask(old_umask)


class WireRefusal(Exception):
    """A request refused on the wire: its gRPC status and the reason, for the service to answer with."""

    def __init__(self, status: Status, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


async def receive_request(stream: Stream[Any, Any], rpc: str, limit: int) -> bytes | None:
    """The request message's bytes, or None when the client went away before sending one; raises WireRefusal for
    a compressed message (no kubelet sends one), one longer than `limit` bytes (before its body is read), or one
    that ends inside its declared length."""
    wire = RequestWire(stream)
    try:
        prefix = await wire.read(MESSAGE_PREFIX.size)
        if not prefix:
            return None
        compressed, length = MESSAGE_PREFIX.unpack(prefix)
        if compressed:
            raise WireRefusal(Status.INVALID_ARGUMENT, f"the {rpc} request is compressed; no kubelet does that")
        if length > limit:
            raise WireRefusal(
                Status.RESOURCE_EXHAUSTED,
                f"{rpc} request of {length} bytes is larger than the {limit} bytes a kubelet sends",
            )
        return await wire.read_exactly(length)
    except EndedInsideMessage:
        raise WireRefusal(Status.INVALID_ARGUMENT, f"the {rpc} request ended inside its message") from None


async def receive_message(
    stream: Stream[Any, Any], rpc: str, limit: int, decode: Callable[[bytes], _Request], refuse: Refuse
) -> _Request | None:
    """The request message, decoded; None when the client went away before sending one. A request refused on the
    wire (`receive_request`), or one that does not decode, is raised as `refuse`'s error."""
    try:
        body = await receive_request(stream, rpc, limit)
    except WireRefusal as refused:
        raise refuse(refused.status, refused.reason) from None
    if body is None:
        return None
    try:
        return decode(body)
    except Exception:  # each protobuf runtime raises what the bytes make it raise
        raise refuse(
            Status.INVALID_ARGUMENT, f"the {rpc} request is not a valid protobuf message; was it sent by a kubelet?"
        ) from None


def unary_handler(
    rpc: str,
    types: tuple[type[_Request], type[_Reply]],
    decode: Callable[[bytes], _Request],
    method: Callable[[_Request], Awaitable[_Reply]],
    *,
    limit: int,
    refuse: Refuse,
) -> Handler:
    """grpclib's handler of a unary RPC whose request is received within `limit` bytes (`receive_message`)."""

    async def handle(stream: Stream[Any, Any]) -> None:
        request = await receive_message(stream, rpc, limit, decode, refuse)
        if request is not None:  # None: the client went away before asking
            await stream.send_message(await method(request))

    return Handler(handle, Cardinality.UNARY_UNARY, *types)


class EndedInsideMessage(Exception):
    """The request's stream ended before the bytes its message prefix declared."""


class _Http2Stream(Protocol):
    async def recv_data(self, size: int) -> bytes: ...


class RequestWire:
    """The request bytes of a server stream as they arrive, read a few at a time.

    grpclib 0.4's public `Stream.recv_message` reads a message whole and offers no size limit (its `Server` and
    `Configuration` have none, and its events come before the body is read or after it is decoded), so this reads
    below it, in exactly two places: the HTTP/2 stream a server `Stream` keeps as `_stream`, and that stream's
    `recv_data(size)`, which returns `b""` when the stream ended before any byte and raises `AssertionError` when it
    ended inside `size` bytes. The version pin (`grpclib>=0.4.9,<0.5`) and tests/deviceplugin/test_servicer.py's guard
    test (`test_grpclib_still_has_what_the_request_wire_reads`) hold both; nothing else in the agent reaches below
    grpclib's public surface."""

    def __init__(self, stream: Stream[Any, Any]) -> None:
        self._stream: _Http2Stream = stream._stream

    async def read(self, size: int) -> bytes:
        """`size` bytes of the request; `b""` when it ended before any (the client went away, or sent nothing);
        raises `EndedInsideMessage` when it ended inside them."""
        try:
            return await self._stream.recv_data(size)
        except AssertionError:  # grpclib's Buffer.read: "Received less data than expected"
            raise EndedInsideMessage(f"the stream ended inside {size} bytes") from None

    async def read_exactly(self, size: int) -> bytes:
        """`size` bytes of the request; raises `EndedInsideMessage` when it ended before them."""
        data = await self.read(size)
        if len(data) != size:  # ended where they should begin
            raise EndedInsideMessage(f"the stream ended before {size} bytes")
        return data
