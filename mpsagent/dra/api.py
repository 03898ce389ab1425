"""The DRA driver's side of the Kubernetes API server, through lightkube: the node's ResourceSlice (published,
removed) and the ResourceClaims the kubelet asks to prepare (read). The claim handler and the slice publisher call
`KubeApi`; `connect` makes one from a kubeconfig or the pod's service account.

What the server returns is untrusted input, turned into the domain's Structs (`domain.claims`) by plain functions
(`claim_allocation`, `resource_slice`) within bounds. Every call is bounded in time, and whatever goes wrong on the
way (no connection, no answer, an HTTP error, an answer that does not decode) is one `KubeApiError` with the HTTP
status when there was one; a claim that cannot be prepared as it stands is a `ClaimRefusedError`, one of those.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import httpx2
import msgspec
from lightkube import ApiError, AsyncClient, KubeConfig, NotReadyError, SingleConfig
from lightkube import ConfigError as LightkubeConfigError
from lightkube.config.client_adapter import verify_cluster
from lightkube.core.client import FieldSelector
from lightkube.models import resource_v1 as models
from lightkube.models.meta_v1 import ObjectMeta, OwnerReference
from lightkube.resources.core_v1 import Node
from lightkube.resources.resource_v1 import ResourceClaim, ResourceSlice

from mpsagent.base.config import quantity_value
from mpsagent.base.errors import (
    ClaimRefusedError,
    DocumentError,
    FileReadError,
    KubeApiError,
    UsageError,
    shown,
)
from mpsagent.base.host import read_input_file
from mpsagent.base.untrusted import load_yaml
from mpsagent.base.values import MIB
from mpsagent.domain.claims import (
    COMPUTE,
    MEMORY,
    CapacityPolicy,
    ClaimAllocation,
    ClaimDevice,
    ClaimRef,
    DeviceTaint,
    NodeSlice,
    OpaqueConfig,
    SliceDevice,
)

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
MAX_RESULTS = 128
"""Device results of this driver on this node in one claim (the API server allows 32 a claim)."""
MAX_CONFIGS = 32
"""Opaque configurations of this driver in one claim (the API server allows 32 a claim or class)."""
MAX_PARAMETERS_BYTES = 64 * 1024
"""An opaque configuration's parameters as JSON (the API server allows 10 KiB)."""
MAX_PODS = 256
"""The pods a claim is reserved for, as the API server bounds them."""
MAX_SLICE_DEVICES = 128
MAX_TAINTED_SLICE_DEVICES = 64
"""Devices in one ResourceSlice when any of them has taints, as the API server bounds them."""
"""Devices in one ResourceSlice, as the API server bounds them."""
MAX_NAME_CHARS = 253
MAX_ATTRIBUTE_CHARS = 64
MAX_LISTED_SLICES = 16
"""The ResourceSlices of this driver on this node read from one list (the agent writes one)."""
"""A string attribute's length, as the API server bounds it."""
CONTENT_ANNOTATION = "mpsagent.io/slice-content"
"""The digest of the NodeSlice a published slice shows: a new digest is a new pool generation."""
_SOURCES = {"FromClass": "class", "FromClaim": "claim"}
_ACCESS_HINT = "give --kubeconfig a kubeconfig file, or leave it out and run the agent in a pod with a service account"


# --- a claim, from the API server's object -----------------------------------------------------------------


def _consumed(ref: ClaimRef, result: models.DeviceRequestAllocationResult, name: str) -> int | None:
    consumed = result.consumedCapacity or {}
    value = consumed.get(name) if isinstance(consumed, dict) else None
    if value is None:
        return None
    amount = quantity_value(value) if isinstance(value, str) else None
    if amount is None:
        problem = "is not a quantity"
    elif amount < 0:
        problem = "is negative"
    elif amount.denominator != 1:  # memory is counted in bytes, compute in whole per cent: `500m` is neither
        problem = "is not a whole number of bytes" if name == MEMORY else "is not a whole per cent"
    else:
        return int(amount)
    raise ClaimRefusedError(str(ref), f"device {shown(result.device)}'s consumed {name} `{shown(value)}` {problem}")


def _claim_device(ref: ClaimRef, result: models.DeviceRequestAllocationResult) -> ClaimDevice:
    return ClaimDevice(
        request=result.request,
        pool=result.pool,
        device=result.device,
        share_id=result.shareID,
        memory_bytes=_consumed(ref, result, MEMORY),
        compute=_consumed(ref, result, COMPUTE),
    )


def _opaque_config(
    ref: ClaimRef, entry: models.DeviceAllocationConfiguration, opaque: models.OpaqueDeviceConfiguration
) -> OpaqueConfig:
    source = _SOURCES.get(entry.source, "claim")  # an unknown source is trusted no more than the claim's own
    parameters = msgspec.json.encode(opaque.parameters)
    if len(parameters) > MAX_PARAMETERS_BYTES:
        raise ClaimRefusedError(
            str(ref),
            f"the parameters of its {source} configuration for {opaque.driver} are {len(parameters)} bytes "
            f"of JSON, more than the {MAX_PARAMETERS_BYTES // 1024} KiB the agent reads",
        )
    return OpaqueConfig(requests=tuple(entry.requests or ()), parameters=parameters, source=source)


def _pods(claim: models.ResourceClaim, namespace: str) -> tuple[str, ...]:
    reserved = (claim.status.reservedFor if claim.status else None) or []
    return tuple(f"{namespace}/{consumer.name}" for consumer in reserved[:MAX_PODS] if consumer.resource == "pods")


def _requests(claim: models.ResourceClaim) -> frozenset[str]:
    """The requests the claim asks, as an allocation result names them: `name`, and `name/sub` for each
    subrequest of a request with alternatives (`firstAvailable`)."""
    spec = claim.spec.devices if claim.spec else None
    names: set[str] = set()
    for request in ((spec.requests if spec else None) or ())[:MAX_RESULTS]:
        names.add(request.name)
        names.update(f"{request.name}/{sub.name}" for sub in (request.firstAvailable or ())[:MAX_RESULTS])
    return frozenset(names)


def claim_allocation(claim: models.ResourceClaim, ref: ClaimRef, *, driver: str, node: str) -> ClaimAllocation:
    """What `claim`, as the API server returned it, was allocated of `driver` on `node` (the pool named after it):
    its device results with their consumed capacity, the driver's opaque configurations (in the server's order:
    the class's, then the claim's), and the pods it is reserved for. No device of this driver and node is an
    empty `devices`: the caller decides.

    Raises ClaimRefusedError when the claim is not the one the kubelet named (another UID: deleted and
    re-created), is not allocated, names a request in its allocation that it does not ask, or holds more than the
    agent reads."""
    uid = claim.metadata.uid if claim.metadata else None
    if uid != ref.uid:
        raise ClaimRefusedError(
            str(ref),
            f"has UID {shown(uid)}, the kubelet asked for {shown(ref.uid)}: it was deleted and re-created",
        )
    allocation = claim.status.allocation if claim.status else None
    if allocation is None:
        raise ClaimRefusedError(
            str(ref), "is not allocated (it has no status.allocation): the scheduler allocates it before the pod"
        )
    devices = allocation.devices or models.DeviceAllocationResult()
    results = [r for r in devices.results or () if r.driver == driver and r.pool == node]
    if len(results) > MAX_RESULTS:
        raise ClaimRefusedError(
            str(ref), f"has {len(results)} devices of {driver} on {node}, more than the {MAX_RESULTS} the agent reads"
        )
    asked = _requests(claim)
    for result in results:
        if result.request not in asked:
            raise ClaimRefusedError(
                str(ref),
                f"its allocation names request `{shown(result.request)}` (device {shown(result.device)}), which the "
                f"claim does not ask ({', '.join(sorted(asked)) or 'no request'}): the allocation is not this claim's",
            )
    configs = [(c, c.opaque) for c in devices.config or () if c.opaque is not None and c.opaque.driver == driver]
    if len(configs) > MAX_CONFIGS:
        raise ClaimRefusedError(
            str(ref), f"has {len(configs)} configurations for {driver}, more than the {MAX_CONFIGS} the agent reads"
        )
    return ClaimAllocation(
        claim=ref,
        devices=tuple(_claim_device(ref, result) for result in results),
        configs=tuple(_opaque_config(ref, entry, opaque) for entry, opaque in configs),
        pods=_pods(claim, ref.namespace),
    )


# --- the node's slice, to the API server's object ----------------------------------------------------------


def slice_name(node: str, driver: str) -> str:
    """The node's one slice of the driver: `<node>-<driver with dots as dashes>`, at most 253 characters (a long
    node name is cut, the driver's part kept)."""
    suffix = "-" + driver.replace(".", "-")
    return node[: MAX_NAME_CHARS - len(suffix)].rstrip("-.") + suffix


def slice_digest(node_slice: NodeSlice) -> str:
    """A digest of everything the slice shows: equal digests, equal slices."""
    return hashlib.sha256(msgspec.json.encode(node_slice)).hexdigest()[:32]


def _capacity(policy: CapacityPolicy) -> models.DeviceCapacity:
    if not policy.has_policy:  # less than one step left: the API server refuses a step beyond the value
        return models.DeviceCapacity(value=str(policy.value))
    return models.DeviceCapacity(
        value=str(policy.value),
        requestPolicy=models.CapacityRequestPolicy(
            default=str(policy.default),
            validRange=models.CapacityRequestPolicyRange(
                min=str(policy.minimum), max=str(policy.maximum), step=str(policy.step)
            ),
        ),
    )


def _taint(taint: DeviceTaint) -> models.DeviceTaint:
    added = datetime.fromtimestamp(int(taint.added), UTC)
    return models.DeviceTaint(key=taint.key, value=taint.value, effect=taint.effect, timeAdded=added)


def _device(device: SliceDevice) -> models.Device:
    attributes = {
        "uuid": models.DeviceAttribute(string=device.uuid[:MAX_ATTRIBUTE_CHARS]),
        "productName": models.DeviceAttribute(string=device.product_name[:MAX_ATTRIBUTE_CHARS]),
        "index": models.DeviceAttribute(int=device.index),
        "computeCapability": models.DeviceAttribute(version=device.compute_capability),
        "driverVersion": models.DeviceAttribute(version=device.driver_version),
        "mpsResource": models.DeviceAttribute(string=device.resource[:MAX_ATTRIBUTE_CHARS]),
    }
    capacity = {MEMORY: _capacity(device.memory), COMPUTE: _capacity(device.compute)}
    return models.Device(
        name=device.name,
        attributes=attributes,
        capacity=capacity,
        allowMultipleAllocations=True,
        taints=[_taint(taint) for taint in device.taints] or None,
    )


def resource_slice(node_slice: NodeSlice, *, generation: int, node_uid: str) -> ResourceSlice:
    """The ResourceSlice that shows `node_slice`, at pool generation `generation`, owned by the Node object (whose
    UID is `node_uid`) so that it goes with the node. Raises KubeApiError for more devices than a slice holds."""
    tainted = any(device.taints for device in node_slice.devices)
    limit = MAX_TAINTED_SLICE_DEVICES if tainted else MAX_SLICE_DEVICES
    if len(node_slice.devices) > limit:
        raise KubeApiError(
            f"publishing the ResourceSlice of node {node_slice.node}",
            f"{len(node_slice.devices)} devices, more than the {limit} a ResourceSlice holds"
            + (" when a device has taints" if tainted else ""),
        )
    owner = OwnerReference(apiVersion="v1", kind="Node", name=node_slice.node, uid=node_uid, controller=False)
    metadata = ObjectMeta(
        name=slice_name(node_slice.node, node_slice.driver),
        annotations={CONTENT_ANNOTATION: slice_digest(node_slice)},
        ownerReferences=[owner],
    )
    spec = models.ResourceSliceSpec(
        driver=node_slice.driver,
        nodeName=node_slice.node,
        pool=models.ResourcePool(name=node_slice.pool, generation=generation, resourceSliceCount=1),
        devices=[_device(device) for device in node_slice.devices],
    )
    return ResourceSlice(metadata=metadata, spec=spec)


def same_pool(existing: models.ResourceSlice, node_slice: NodeSlice) -> bool:
    """Whether the existing slice can be updated into this one: driver, node and pool name are immutable."""
    spec = existing.spec
    return (spec.driver, spec.nodeName, spec.pool.name) == (node_slice.driver, node_slice.node, node_slice.pool)


def next_generation(existing: models.ResourceSlice | None, node_slice: NodeSlice) -> int:
    """The pool generation to publish `node_slice` at: 1 for a new slice, the existing one's while it shows the
    same, one more when anything changed (the scheduler counts only the slices of a pool's highest generation)."""
    if existing is None:
        return 1
    annotations = (existing.metadata.annotations if existing.metadata else None) or {}
    unchanged = annotations.get(CONTENT_ANNOTATION) == slice_digest(node_slice) and same_pool(existing, node_slice)
    return existing.spec.pool.generation + (0 if unchanged else 1)


def slice_matches(existing: models.ResourceSlice, desired: ResourceSlice) -> bool:
    """Whether the server's slice `existing` shows what the agent's `desired` (from `resource_slice`) says: the
    same content annotation, and every field of the spec the agent writes holding the agent's value (lists of the
    same length; capacities by amount, as the server writes `1073741824` back as `1Gi`). Fields the agent does not
    write are not compared, so that the server's defaults are no difference."""
    devices = existing.spec.devices or ()
    if len(devices) > MAX_SLICE_DEVICES or _content(existing) != _content(desired):
        return False
    return _holds(desired.spec.to_dict(), existing.spec.to_dict())


def _content(item: models.ResourceSlice) -> str | None:
    annotations = (item.metadata.annotations if item.metadata else None) or {}
    return annotations.get(CONTENT_ANNOTATION)


def _holds(want: object, have: object, *, amounts: bool = False) -> bool:
    """Whether `have` holds `want` (the agent's own, so the walk is as deep as the agent wrote, whatever `have`
    is); strings under a `capacity` are quantities when `amounts`."""
    if isinstance(want, dict):
        return isinstance(have, dict) and all(
            _holds(value, have.get(key), amounts=amounts or key == "capacity") for key, value in want.items()
        )
    if isinstance(want, list):
        return (
            isinstance(have, list)
            and len(have) == len(want)
            and all(_holds(w, h, amounts=amounts) for w, h in zip(want, have, strict=True))
        )
    if amounts and isinstance(want, str) and isinstance(have, str) and want != have:
        amount = quantity_value(want)
        return amount is not None and quantity_value(have) == amount
    return type(want) is type(have) and want == have


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
        async with _call(f"reading ResourceClaim {ref}"):
            claim = await self._client.get(ResourceClaim, ref.name, namespace=ref.namespace)
        return claim_allocation(claim, ref, driver=driver, node=node)

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
            items: list[ResourceSlice] = []
            iterator = aiter(found)
            try:
                async for item in iterator:
                    items.append(item)
                    if len(items) == MAX_LISTED_SLICES:
                        break
            finally:
                await _close(iterator)
            try:
                version = found.resourceVersion
            except NotReadyError:
                raise KubeApiError(doing, "the list has no resourceVersion to watch from") from None
        return items, version

    async def watch_slices(
        self, *, driver: str, node: str, resource_version: str
    ) -> AsyncGenerator[tuple[str, ResourceSlice], None]:
        """The changes to the ResourceSlices of `driver` on `node` after `resource_version`, as lightkube reads
        them: (`ADDED`, `MODIFIED` or `DELETED`, the object), for as long as the caller reads (close it: the
        response stays open until then); a stream the server ends is watched again from the last change seen.
        Bounded in time by the caller, not here. Raises KubeApiError when the watch fails (an `ERROR` event, such
        as 410 for a `resource_version` too old: list again)."""
        events = self._client.watch(ResourceSlice, fields=_selector(driver, node), resource_version=resource_version)
        try:
            async for kind, item in events:
                yield kind, item
        except (*_FAILURES, AttributeError) as exc:  # lightkube reads an event's metadata, which may be missing
            raise _api_error(f"watching the ResourceSlices of {driver} on node {node}", exc) from exc
        finally:
            await _close(events)

    async def node_uid(self, node: str) -> str:
        """The UID of the Node object named `node` (a slice's owner); empty when the server gives none."""
        async with _call(f"reading Node {node}"):
            found = await self._client.get(Node, node)
        return found.metadata.uid if found.metadata and found.metadata.uid else ""

    async def apply_slice(self, desired: ResourceSlice) -> ResourceSlice:
        """Create or update the slice to be `desired` (server-side apply, taking over any field another manager
        set); the slice as the server now holds it."""
        name = desired.metadata.name if desired.metadata else None
        async with _call(f"publishing ResourceSlice {name}"):
            return await self._client.apply(desired, field_manager=FIELD_MANAGER, force=True)

    async def delete_slice(self, name: str) -> bool:
        """Delete the ResourceSlice `name`; False when it was already gone."""
        async with _call(f"deleting ResourceSlice {name}"):
            return await self._delete_slice(name)

    async def close(self) -> None:
        await self._client.close()


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
