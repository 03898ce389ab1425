"""The DRA driver's client of the Kubernetes API server, through lightkube: the node's ResourceSlices (listed,
watched, applied, deleted), the ResourceClaims the kubelet asks to prepare (read), the cluster's DeviceTaintRules
(listed and watched), and an Event on one of the node's pods (found by its UID). The claim handler and the
slice publisher call `KubeApi`; `connect` makes one from a kubeconfig or the pod's service account.

The objects are translated by plain functions beside it: a claim into the domain's `ClaimAllocation`
(`claim_object`), the node's slice into the object the server reads (`slice_object`). Every call is bounded in time,
and whatever goes wrong on the way (no connection, no answer, an HTTP error, an answer that does not decode) is one
`KubeApiError` with the HTTP status when there was one; a claim that cannot be prepared as it stands is a
`ClaimRefusedError`, one of those.
"""

from __future__ import annotations

import os
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar, cast

import anyio
import httpx2
import msgspec
from lightkube import ApiError, AsyncClient, KubeConfig, NotReadyError, SingleConfig
from lightkube import ConfigError as LightkubeConfigError
from lightkube.config.client_adapter import verify_cluster
from lightkube.core.client import FieldSelector
from lightkube.core.generic_client import ListAsyncIterable
from lightkube.models.core_v1 import EventSource, ObjectReference
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Event, Node, Pod
from lightkube.resources.resource_v1 import DeviceTaintRule, ResourceClaim, ResourceSlice

from mpsagent.base.errors import (
    DocumentError,
    FileReadError,
    KubeApiError,
    UsageError,
    shown,
)
from mpsagent.base.host import read_input_file
from mpsagent.base.untrusted import load_yaml
from mpsagent.base.values import MIB
from mpsagent.domain.claims import ClaimAllocation, ClaimRef
from mpsagent.dra.claim_object import claim_allocation, reserved_pods
from mpsagent.dra.slice_object import SliceManifest

FIELD_MANAGER = "mpsagent"
"""Who owns the slice's fields in server-side apply."""
REQUEST_TIMEOUT_S = 10.0
"""Connecting, sending, and each wait for the answer's bytes."""
CALL_TIMEOUT_S = 30.0
"""A whole call (a publish is three requests), however the server drips its answer."""
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
KEEPALIVE_S = 120.0
"""How long an idle connection to the API server is kept for the next call."""
MAX_CONNECTIONS = 16
"""Connections to the API server at once: the slice's watch, the claims one prepare reads at once, a write."""
MAX_KUBECONFIG_BYTES = 4 * MIB
MAX_LISTED_SLICES = 16
"""The ResourceSlices of this driver on this node read from one list (the agent writes one)."""
MAX_LISTED_TAINT_RULES = 4096
"""The cluster's DeviceTaintRules read from one list (the agent keeps those that taint its devices)."""
LIST_CHUNK = 500
"""Objects asked of the API server at a time in a list of many."""
MAX_LISTED_PODS = 2048
"""The node's pods read to find one by its UID (a kubelet runs 110 by default, at most a few hundred)."""
EVENT_SOURCE = "mpsagent"
_T = TypeVar("_T")


@dataclass(frozen=True, kw_only=True, slots=True)
class PodRef:
    """A pod on the node, and the name of one of its containers (None: not among its statuses)."""

    namespace: str
    name: str
    uid: str
    container: str | None

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


_ACCESS_HINT = "give --kubeconfig a kubeconfig file, or leave it out and run the agent in a pod with a service account"


# --- the client ---------------------------------------------------------------------------------------------


def _status_of(exc: ApiError) -> int | None:
    response = getattr(exc, "response", None)
    code = exc.status.code if exc.status is not None else None
    return code or (response.status_code if response is not None else None)


_FAILURES = (httpx2.HTTPError, TimeoutError, LightkubeConfigError, ValueError, KeyError)
"""What a lightkube call raises when it goes wrong (its ApiError is an httpx2.HTTPStatusError; msgspec's
DecodeError a ValueError)."""


def _api_error(doing: str, exc: BaseException) -> KubeApiError:
    """One of `_FAILURES` as the KubeApiError that says what the agent was `doing`."""
    if isinstance(exc, ApiError):
        message = exc.status.message if exc.status is not None else None
        return KubeApiError(doing, shown(message or "the server gave no reason", 300), _status_of(exc))
    if isinstance(exc, httpx2.HTTPStatusError):
        return KubeApiError(doing, shown(exc.response.reason_phrase, 300), exc.response.status_code)
    if isinstance(exc, httpx2.TimeoutException):
        return KubeApiError(doing, f"no answer within {REQUEST_TIMEOUT_S:g} s ({type(exc).__name__})")
    if isinstance(exc, TimeoutError):
        return KubeApiError(doing, f"no complete answer within {CALL_TIMEOUT_S:g} s")
    if isinstance(exc, httpx2.HTTPError):
        return KubeApiError(doing, shown(str(exc) or type(exc).__name__, 300))
    if isinstance(exc, LightkubeConfigError):
        return KubeApiError(doing, f"the credentials cannot be used: {shown(exc, 300)}")
    failed = _status_error_under(exc)
    if failed is not None:
        return KubeApiError(doing, shown(failed.response.reason_phrase, 300), failed.response.status_code)
    return KubeApiError(doing, f"the answer is not what the API says: {shown(exc, 300)}")


@asynccontextmanager
async def _call(doing: str) -> AsyncIterator[None]:
    """Turn whatever goes wrong in the block into a KubeApiError that says what the agent was `doing`."""
    try:
        with anyio.fail_after(CALL_TIMEOUT_S):
            yield
    except _FAILURES as exc:
        raise _api_error(doing, exc) from exc


def _status_error_under(exc: BaseException) -> httpx2.HTTPStatusError | None:
    """The HTTP error answer lightkube was reading when it failed (an error answer that is not a Status, or
    one without a Content-Type): the status is still worth saying."""
    seen: BaseException | None = exc.__context__
    for _ in range(8):
        if seen is None or isinstance(seen, httpx2.HTTPStatusError):
            return seen
        seen = seen.__context__
    return None


class KubeApi:
    """The calls the DRA driver makes to the API server. Each is bounded in time and raises KubeApiError, with
    the HTTP status when the server answered."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def read_claim(self, ref: ClaimRef, *, driver: str, node: str) -> ClaimAllocation:
        """What the claim the kubelet named was allocated of `driver` on `node` (`claim_allocation`). Raises
        ClaimRefusedError for a claim that cannot be prepared as it stands, KubeApiError (404: it is gone) when
        it cannot be read."""
        return claim_allocation(await self._claim(ref), ref, driver=driver, node=node)

    async def claim_pods(self, ref: ClaimRef) -> tuple[str, ...] | None:
        """The pods the claim is reserved for now (`reserved_pods`); None when it is gone."""
        try:
            claim = await self._claim(ref)
        except KubeApiError as exc:
            if exc.status == 404:
                return None
            raise
        return reserved_pods(claim, ref)

    async def _claim(self, ref: ClaimRef) -> ResourceClaim:
        async with _call(f"reading ResourceClaim {ref}"):
            return await self._client.get(ResourceClaim, ref.name, namespace=ref.namespace)

    async def _delete_slice(self, name: str) -> bool:
        try:
            await self._client.delete(ResourceSlice, name)
        except ApiError as exc:
            if _status_of(exc) == 404:
                return False
            raise
        return True

    # --- the slice publisher's calls: one call, one request -------------------------------------------------

    async def list_slices(self, *, driver: str, node: str) -> tuple[list[ResourceSlice], str]:
        """The ResourceSlices of `driver` on `node` (the first MAX_LISTED_SLICES: the rest are not read), and the
        resourceVersion the list was taken at, to watch from."""
        doing = f"listing the ResourceSlices of {driver} on node {node}"
        async with _call(doing):
            found = self._client.list(ResourceSlice, fields=_selector(driver, node), chunk_size=MAX_LISTED_SLICES)
            return await _first(found, MAX_LISTED_SLICES, doing)

    def watch_slices(
        self, *, driver: str, node: str, resource_version: str
    ) -> AsyncGenerator[tuple[str, ResourceSlice], None]:
        """The changes to the ResourceSlices of `driver` on `node` after `resource_version`, as lightkube reads
        them: (`ADDED`, `MODIFIED` or `DELETED`, the object), for as long as the caller reads (close it: the
        response stays open until then); a stream the server ends is watched again from the last change seen.
        Bounded in time by the caller, not here. Raises KubeApiError when the watch fails (an `ERROR` event, such
        as 410 for a `resource_version` too old: list again)."""
        events = self._client.watch(ResourceSlice, fields=_selector(driver, node), resource_version=resource_version)
        return _changes(events, f"watching the ResourceSlices of {driver} on node {node}")

    async def list_taint_rules(self) -> tuple[list[DeviceTaintRule], str]:
        """The cluster's DeviceTaintRules (`resource.k8s.io/v1`; the first MAX_LISTED_TAINT_RULES: the rest are not
        read), and the resourceVersion the list was taken at, to watch from. KubeApiError 404: the API server serves
        none (Kubernetes before 1.37)."""
        doing = "listing the DeviceTaintRules"
        async with _call(doing):
            found = self._client.list(DeviceTaintRule, chunk_size=LIST_CHUNK)
            return await _first(found, MAX_LISTED_TAINT_RULES, doing)

    def watch_taint_rules(self, *, resource_version: str) -> AsyncGenerator[tuple[str, DeviceTaintRule], None]:
        """The changes to the cluster's DeviceTaintRules after `resource_version`, as `watch_slices` gives the
        slices'."""
        events = self._client.watch(DeviceTaintRule, resource_version=resource_version)
        return _changes(events, "watching the DeviceTaintRules")

    async def node_uid(self, node: str) -> str:
        """The UID of the Node object named `node` (a slice's owner); empty when the server gives none."""
        async with _call(f"reading Node {node}"):
            found = await self._client.get(Node, node)
        return found.metadata.uid if found.metadata and found.metadata.uid else ""

    async def apply_slice(self, desired: SliceManifest) -> ResourceSlice:
        """Create or update the slice to be `desired` (server-side apply, taking over any field another manager
        set); the slice as the server now holds it."""
        async with _call(f"publishing ResourceSlice {desired['metadata']['name']}"):
            slice_object = cast(ResourceSlice, ResourceSlice.from_dict(desired))
            return await self._client.apply(slice_object, field_manager=FIELD_MANAGER, force=True)

    async def delete_slice(self, name: str) -> bool:
        """Delete the ResourceSlice `name`; False when it was already gone."""
        async with _call(f"deleting ResourceSlice {name}"):
            return await self._delete_slice(name)

    async def pod_of(self, *, node: str, uid: str, container_id: str) -> PodRef | None:
        """The pod with `uid` among `node`'s pods (its first MAX_LISTED_PODS), and the name of its container whose
        runtime ID is `container_id`; None when it is not there (deleted since)."""
        async with _call(f"listing the pods of node {node}"):
            found = self._client.list(Pod, namespace="*", fields={"spec.nodeName": node}, chunk_size=LIST_CHUNK)
            iterator = aiter(found)
            try:
                seen = 0
                async for pod in iterator:
                    seen += 1
                    if pod.metadata is not None and pod.metadata.uid == uid:
                        return _pod_ref(pod, container_id)
                    if seen == MAX_LISTED_PODS:
                        break
            finally:
                await _close(iterator)
        return None

    async def pod_event(self, pod: PodRef, *, node: str, reason: str, message: str) -> None:
        """A Warning Event on `pod` (and its container, when known), from this agent on `node`."""
        now = datetime.now(UTC)
        event = Event(
            metadata=ObjectMeta(generateName=f"{pod.name}.", namespace=pod.namespace),
            involvedObject=ObjectReference(
                apiVersion="v1",
                kind="Pod",
                namespace=pod.namespace,
                name=pod.name,
                uid=pod.uid,
                fieldPath=None if pod.container is None else f"spec.containers{{{pod.container}}}",
            ),
            reason=reason,
            message=message,
            type="Warning",
            source=EventSource(component=EVENT_SOURCE, host=node),
            reportingComponent=EVENT_SOURCE,
            reportingInstance=node,
            firstTimestamp=now,
            lastTimestamp=now,
            count=1,
        )
        async with _call(f"recording an Event on pod {pod}"):
            await self._client.create(event)

    async def close(self) -> None:
        await self._client.close()


def _pod_ref(pod: Pod, container_id: str) -> PodRef:
    assert pod.metadata is not None
    statuses = (
        [] if pod.status is None else [*(pod.status.containerStatuses or ()), *(pod.status.initContainerStatuses or ())]
    )
    names = [s.name for s in statuses if s.containerID and s.containerID.rpartition("://")[2] == container_id]
    return PodRef(
        namespace=pod.metadata.namespace or "",
        name=pod.metadata.name or "",
        uid=pod.metadata.uid or "",
        container=names[0] if names else None,
    )


async def _first(found: ListAsyncIterable[_T], limit: int, doing: str) -> tuple[list[_T], str]:
    """The first `limit` objects of a list, and the resourceVersion it was taken at."""
    items: list[_T] = []
    iterator = aiter(found)
    try:
        async for item in iterator:
            items.append(item)
            if len(items) == limit:
                break
    finally:
        await _close(iterator)
    try:
        return items, found.resourceVersion
    except NotReadyError:
        raise KubeApiError(doing, "the list has no resourceVersion to watch from") from None


async def _changes(events: AsyncIterable[tuple[str, _T]], doing: str) -> AsyncGenerator[tuple[str, _T], None]:
    """A watch's events, whatever goes wrong in them a KubeApiError that says what the agent was `doing`; the watch
    closed when the caller closes this."""
    try:
        async for kind, item in events:
            yield kind, item
    except (*_FAILURES, AttributeError) as exc:  # lightkube reads an event's metadata, which may be missing
        raise _api_error(doing, exc) from exc
    finally:
        await _close(events)


def _selector(driver: str, node: str) -> FieldSelector:
    return {"spec.driver": driver, "spec.nodeName": node}


async def _close(iterator: object) -> None:
    """Close a lightkube iterator left before its end (a watch holds its response open until then), even while
    the caller is being cancelled."""
    close = getattr(iterator, "aclose", None)
    if close is not None:
        with anyio.CancelScope(shield=True):
            await close()


# --- credentials --------------------------------------------------------------------------------------------


def _config_problem(exc: Exception) -> str:
    if isinstance(exc, KeyError):
        return f"no entry `{shown(exc.args[0] if exc.args else '?')}`"
    if isinstance(exc, OSError) and exc.strerror:
        where = f": {shown(exc.filename, 200)}" if exc.filename else ""
        return f"a file it names cannot be read ({exc.strerror}{where})"
    return shown(str(exc) or type(exc).__name__, 200)


def _file_config(path: Path) -> SingleConfig:
    try:
        text = read_input_file(path, max_bytes=MAX_KUBECONFIG_BYTES, what="--kubeconfig").decode("utf-8")
    except FileReadError as exc:
        raise UsageError(f"{exc}; {_ACCESS_HINT}") from exc
    except UnicodeDecodeError as exc:
        raise UsageError(f"--kubeconfig {path}: is not UTF-8 text (at byte {exc.start})") from exc
    try:
        data: Any = load_yaml(text)
    except DocumentError as exc:
        raise UsageError(f"--kubeconfig {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise UsageError(f"--kubeconfig {path}: is not a usable kubeconfig (not a mapping); {_ACCESS_HINT}")
    try:
        config = KubeConfig.from_dict(data, fname=path).get()
    except (LightkubeConfigError, KeyError, TypeError, AttributeError, msgspec.ValidationError) as exc:
        raise UsageError(
            f"--kubeconfig {path}: is not a usable kubeconfig ({_config_problem(exc)}); {_ACCESS_HINT}"
        ) from exc
    if config is None or config.user is None:
        raise UsageError(f"--kubeconfig {path}: its current context names no user; {_ACCESS_HINT}")
    return config


def _in_cluster_config(service_account: Path) -> SingleConfig:
    missing = [name for name in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT") if not os.environ.get(name)]
    reason = f"{' and '.join(missing)} not set" if missing else None
    if reason is None:
        try:
            config = KubeConfig.from_service_account(service_account).get()
        except (LightkubeConfigError, OSError, KeyError) as exc:
            reason = f"no service account token and namespace in {service_account} ({_config_problem(exc)})"
        else:
            if config is not None:
                return config
            reason = "no context"
    raise UsageError(f"no --kubeconfig given, and no in-cluster credentials: {reason}; {_ACCESS_HINT}")


def _check_named_files(config: SingleConfig, source: str) -> None:
    """Each file the credentials name (relative: to the kubeconfig) exists, so that a missing one is named."""
    user = config.user
    named = [("certificate-authority", config.cluster.certificate_auth)]
    if user is not None:
        named += [
            ("client-certificate", user.client_cert),
            ("client-key", user.client_key),
            ("tokenFile", user.token_file),
        ]
    for key, value in named:
        if value and not Path(config.abs_file(value)).is_file():
            raise UsageError(f"{source}: its {key} {Path(config.abs_file(value))} is not a file; {_ACCESS_HINT}")


async def connect(kubeconfig: Path | None, *, service_account: Path = SERVICE_ACCOUNT) -> KubeApi:
    """A client of the API server with the credentials of `kubeconfig` (its current context), or, without one,
    of the pod's service account (`service_account`, with the KUBERNETES_SERVICE_HOST/PORT environment). Nothing
    is sent yet. Raises UsageError naming the file and what to do when there are no usable credentials."""
    config = _file_config(kubeconfig) if kubeconfig is not None else _in_cluster_config(service_account)
    source = f"--kubeconfig {kubeconfig}" if kubeconfig is not None else f"the service account {service_account}"
    _check_named_files(config, source)
    try:
        assert config.user is not None  # both readers refuse credentials without a user
        # lightkube's own transport, with connections kept between calls: a prepare's claim read reuses one (a new
        # TLS connection cost 10 to 15 ms of it, after httpx's 5 s keep-alive).
        transport = httpx2.AsyncHTTPTransport(
            verify=verify_cluster(config.cluster, config.user, config.abs_file),
            limits=httpx2.Limits(max_connections=MAX_CONNECTIONS, keepalive_expiry=KEEPALIVE_S),
        )
        client = AsyncClient(
            config, timeout=httpx2.Timeout(REQUEST_TIMEOUT_S), field_manager=FIELD_MANAGER, transport=transport
        )
    except (LightkubeConfigError, OSError, ValueError) as exc:
        raise UsageError(f"{source}: its credentials cannot be used ({_config_problem(exc)}); {_ACCESS_HINT}") from exc
    return KubeApi(client)
