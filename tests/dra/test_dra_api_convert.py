"""The API server adapter's conversions, without a server: a ResourceClaim as the API server returns it into what
it was allocated of this driver on this node (within bounds, refused when it is not the claim the kubelet named),
and the node's slice into the ResourceSlice the server is given, with its pool generation."""

from __future__ import annotations

import copy
import json
from typing import Any

import kubernetes_validate
import msgspec
import pytest
from lightkube.resources.resource_v1 import ResourceClaim, ResourceSlice

from mpsagent.base.devices import MIB
from mpsagent.base.errors import ClaimRefusedError, KubeApiError
from mpsagent.domain.claims import (
    DRA_DRIVER,
    CapacityPolicy,
    ClaimDevice,
    ClaimRef,
    DeviceTaint,
    NodeSlice,
    OpaqueConfig,
)
from mpsagent.dra.claim_object import MAX_CONFIGS, MAX_RESULTS, claim_allocation
from mpsagent.dra.slice_object import CONTENT_ANNOTATION, next_generation, resource_slice, slice_digest, slice_name
from mpsagent_testing.kube_api import (
    CLAIM,
    CLAIM_PARAMETERS,
    CLASS_PARAMETERS,
    GIB,
    NODE,
    NODE_SLICE,
    REF,
    UID,
    slice_device,
)


def claim(edit: Any = None) -> ResourceClaim:
    document = copy.deepcopy(CLAIM)
    if edit is not None:
        edit(document)
    return ResourceClaim.from_dict(document)


def results(document: dict[str, Any]) -> list[dict[str, Any]]:
    return document["status"]["allocation"]["devices"]["results"]  # type: ignore[no-any-return]


def test_a_claim_becomes_what_it_was_allocated_of_this_driver_on_this_node() -> None:
    allocation = claim_allocation(claim(), REF, driver=DRA_DRIVER, node=NODE)
    assert allocation.claim == REF
    assert allocation.devices == (
        ClaimDevice(
            request="gpu",
            pool=NODE,
            device="gpu-0",
            share_id="2f1b8c5e-93d4-4b7a-a0c1-5e6f7a8b9c0d",
            memory_bytes=8 << 30,
            compute=25,
        ),
        ClaimDevice(request="whole", pool=NODE, device="gpu-1"),
    )
    assert [(c.source, c.requests) for c in allocation.configs] == [("class", ()), ("claim", ("gpu",))]
    assert [json.loads(c.parameters) for c in allocation.configs] == [CLASS_PARAMETERS, CLAIM_PARAMETERS]
    assert allocation.configs[0] == OpaqueConfig(
        requests=(),
        parameters=b'{"apiVersion":"mps.mpsagent.io/v1alpha1","kind":"ShareParameters","threadPercentage":50}',
        source="class",
    )
    assert allocation.pods == ("team-a/trainer-0",)


def test_quantities_read_as_the_api_server_writes_them() -> None:
    def edit(document: dict[str, Any]) -> None:
        results(document)[0]["consumedCapacity"] = {"memory": "1536Mi", "compute": "100"}

    device = claim_allocation(claim(edit), REF, driver=DRA_DRIVER, node=NODE).devices[0]
    assert (device.memory_bytes, device.compute) == (1536 << 20, 100)


def test_a_claim_with_no_device_of_this_node_has_none() -> None:
    allocation = claim_allocation(claim(), REF, driver=DRA_DRIVER, node="node-3")
    assert allocation.devices == ()
    assert len(allocation.configs) == 2  # the configurations are the driver's, wherever its devices are


def test_a_re_created_claim_is_refused() -> None:
    ref = ClaimRef(namespace="team-a", name="trainer-gpu", uid="00000000-1111-4000-8000-000000000000")
    with pytest.raises(ClaimRefusedError) as caught:
        claim_allocation(claim(), ref, driver=DRA_DRIVER, node=NODE)
    assert str(caught.value) == (
        f"claim team-a/trainer-gpu: has UID {UID}, the kubelet asked for 00000000-1111-4000-8000-000000000000: "
        "it was deleted and re-created"
    )


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: d["status"].pop("allocation"),
        lambda d: d.pop("status"),
    ],
    ids=["no allocation", "no status"],
)
def test_an_unallocated_claim_is_refused(edit: Any) -> None:
    with pytest.raises(ClaimRefusedError) as caught:
        claim_allocation(claim(edit), REF, driver=DRA_DRIVER, node=NODE)
    assert str(caught.value) == (
        "claim team-a/trainer-gpu: is not allocated (it has no status.allocation): "
        "the scheduler allocates it before the pod"
    )


@pytest.mark.parametrize(
    ("consumed", "said"),
    [
        ({"memory": "lots"}, "memory `lots` is not a quantity"),
        ({"memory": 8}, "memory `8` is not a quantity"),
        ({"memory": "8GB"}, "memory `8GB` is not a quantity"),
        ({"memory": "-8Gi"}, "memory `-8Gi` is negative"),
        ({"compute": "-5"}, "compute `-5` is negative"),
        ({"memory": "500m"}, "memory `500m` is not a whole number of bytes"),
        ({"memory": "1.5"}, "memory `1.5` is not a whole number of bytes"),
        ({"compute": "1.5"}, "compute `1.5` is not a whole per cent"),
        ({"compute": "250m"}, "compute `250m` is not a whole per cent"),
    ],
)
def test_a_consumed_capacity_that_is_no_amount_says_what_is_wrong(consumed: dict[str, Any], said: str) -> None:
    def edit(document: dict[str, Any]) -> None:
        results(document)[0]["consumedCapacity"] = consumed

    with pytest.raises(ClaimRefusedError) as caught:
        claim_allocation(claim(edit), REF, driver=DRA_DRIVER, node=NODE)
    assert str(caught.value) == f"claim team-a/trainer-gpu: device gpu-0's consumed {said}"


@pytest.mark.parametrize(
    ("consumed", "named"),
    [
        ({"memory": "8Gi", "bogus": "5"}, "'bogus'"),
        ({"compute": "25", **{f"x{i}": "1" for i in range(6)}}, "'x0', 'x1', 'x2' and 3 more"),
        ({"z" * 5000: "1", "a\nb": "1"}, "'a\\nb', '" + "z" * 80 + "...'"),
    ],
    ids=["one", "many", "long-and-odd"],
)
def test_a_consumed_capacity_the_devices_do_not_have_is_refused_naming_it(consumed: dict[str, Any], named: str) -> None:
    """Issue 37: `bogus: 5` was prepared without a word. The scheduler consumes only what the device offers: a name
    the node's devices do not have means the allocation did not come from the node's slice. At most three names,
    each cut to 80 characters and escaped, so that a hostile claim cannot flood the pod's events."""

    def edit(document: dict[str, Any]) -> None:
        results(document)[0]["consumedCapacity"] = consumed

    with pytest.raises(ClaimRefusedError) as caught:
        claim_allocation(claim(edit), REF, driver=DRA_DRIVER, node=NODE)
    assert str(caught.value) == (
        f"claim team-a/trainer-gpu: device gpu-0's consumed capacity names {named}, which the devices of "
        f"{DRA_DRIVER} do not have (they have memory, compute and clients): the allocation was not made from the "
        "node's ResourceSlice"
    )


@pytest.mark.parametrize(
    ("consumed", "amounts"),
    [
        ({"memory": "8000m", "compute": "25000m"}, (8, 25)),
        ({"memory": "1.5Ki", "compute": "2.5e1"}, (1536, 25)),
        ({"memory": "0", "compute": "0"}, (0, 0)),
    ],
)
def test_a_whole_amount_in_any_quantity_form_is_read(consumed: dict[str, Any], amounts: tuple[int, int]) -> None:
    def edit(document: dict[str, Any]) -> None:
        results(document)[0]["consumedCapacity"] = consumed

    device = claim_allocation(claim(edit), REF, driver=DRA_DRIVER, node=NODE).devices[0]
    assert (device.memory_bytes, device.compute) == amounts


def test_oversized_parameters_are_refused() -> None:
    def edit(document: dict[str, Any]) -> None:
        config = document["status"]["allocation"]["devices"]["config"][2]
        config["opaque"]["parameters"] = {"kind": "ShareParameters", "padding": "x" * 70_000}

    with pytest.raises(ClaimRefusedError) as caught:
        claim_allocation(claim(edit), REF, driver=DRA_DRIVER, node=NODE)
    assert str(caught.value) == (
        "claim team-a/trainer-gpu: the parameters of its claim configuration for mps.mpsagent.io are 70039 bytes "
        "of JSON, more than the 64 KiB the agent reads"
    )


def test_more_results_of_this_driver_and_node_than_the_agent_reads_are_refused() -> None:
    def edit(document: dict[str, Any]) -> None:
        document["status"]["allocation"]["devices"]["results"] = [
            {"request": "gpu", "driver": DRA_DRIVER, "pool": NODE, "device": f"gpu-{i}"} for i in range(129)
        ] + [{"request": "gpu", "driver": "other.example.com", "pool": NODE, "device": "x"}] * 500

    with pytest.raises(ClaimRefusedError, match=rf"has 129 devices of {DRA_DRIVER} on {NODE}, more than the 128"):
        claim_allocation(claim(edit), REF, driver=DRA_DRIVER, node=NODE)
    assert MAX_RESULTS == 128


def test_more_configurations_of_this_driver_than_the_agent_reads_are_refused() -> None:
    def edit(document: dict[str, Any]) -> None:
        entry = {"source": "FromClaim", "opaque": {"driver": DRA_DRIVER, "parameters": {}}}
        document["status"]["allocation"]["devices"]["config"] = [entry] * (MAX_CONFIGS + 1)

    with pytest.raises(ClaimRefusedError, match=rf"has 33 configurations for {DRA_DRIVER}, more than the 32"):
        claim_allocation(claim(edit), REF, driver=DRA_DRIVER, node=NODE)


def test_an_unknown_configuration_source_is_trusted_as_the_claims_own() -> None:
    def edit(document: dict[str, Any]) -> None:
        document["status"]["allocation"]["devices"]["config"][0]["source"] = "FromSomewhereNew"

    allocation = claim_allocation(claim(edit), REF, driver=DRA_DRIVER, node=NODE)
    assert [c.source for c in allocation.configs] == ["claim", "claim"]


# --- the node's slice --------------------------------------------------------------------------------------


def test_the_slice_shows_each_gpu_with_its_attributes_and_consumable_capacity() -> None:
    document = resource_slice(NODE_SLICE, generation=3, node_uid="4f6e3d2c-node")
    assert document["apiVersion"] == "resource.k8s.io/v1"
    assert document["kind"] == "ResourceSlice"
    assert document["metadata"] == {
        "name": "node-1-mps-mpsagent-io",
        "annotations": {CONTENT_ANNOTATION: slice_digest(NODE_SLICE)},
        "ownerReferences": [
            {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": "4f6e3d2c-node", "controller": False}
        ],
    }
    spec = document["spec"]
    assert (spec["driver"], spec["nodeName"]) == (DRA_DRIVER, NODE)
    assert spec["pool"] == {"name": NODE, "generation": 3, "resourceSliceCount": 1}
    assert spec["devices"][1] == {
        "name": "gpu-1",
        "allowMultipleAllocations": True,
        "attributes": {
            "uuid": {"string": "GPU-5c1f0e7a-0000-4000-8000-000000000001"},
            "productName": {"string": "NVIDIA H200"},
            "index": {"int": 1},
            "computeCapability": {"version": "9.0.0"},
            "driverVersion": {"version": "580.65.6"},
            "mpsResource": {"string": "nvidia.com/gpu"},
        },
        "capacity": {
            "memory": {
                "value": str(141 * GIB),
                "requestPolicy": {
                    "default": str(GIB),
                    "validRange": {"min": "1048576", "max": str(141 * GIB), "step": "1048576"},
                },
            },
            "compute": {
                "value": "100",
                "requestPolicy": {"default": "100", "validRange": {"min": "1", "max": "100", "step": "1"}},
            },
            "clients": {
                "value": "48",
                "requestPolicy": {"default": "1", "validRange": {"min": "1", "max": "1", "step": "1"}},
            },
        },
    }


def test_the_slice_is_valid_for_the_api_server() -> None:
    document = resource_slice(NODE_SLICE, generation=1, node_uid="4f6e3d2c-node")
    kubernetes_validate.validate(document, "1.34", strict=True)


def test_a_long_product_name_is_cut_to_what_an_attribute_holds() -> None:
    node_slice = NodeSlice(driver=DRA_DRIVER, node=NODE, pool=NODE, devices=(slice_device(0, "N" * 100),))
    device = resource_slice(node_slice, generation=1, node_uid="u")["spec"]["devices"][0]
    assert device["attributes"]["productName"] == {"string": "N" * 64}


def test_more_devices_than_a_slice_holds_are_refused() -> None:
    node_slice = NodeSlice(driver=DRA_DRIVER, node=NODE, pool=NODE, devices=(slice_device(0),) * 129)
    with pytest.raises(KubeApiError, match="129 devices, more than the 128 a ResourceSlice holds"):
        resource_slice(node_slice, generation=1, node_uid="u")


def test_the_slice_name_is_the_node_and_the_driver_within_253_characters() -> None:
    assert slice_name("gpu-node-7.example.com", DRA_DRIVER) == "gpu-node-7.example.com-mps-mpsagent-io"
    long = slice_name("a" * 250 + ".b", DRA_DRIVER)
    assert len(long) == 253 and long.endswith("a-mps-mpsagent-io")


def published(node_slice: NodeSlice, generation: int) -> dict[str, Any]:
    """The slice as the API server returns it (quantities in canonical form, fields it adds), as the API client
    gives it to the publisher: read into its object, then `to_dict()`."""
    document = resource_slice(node_slice, generation=generation, node_uid="u")
    document["metadata"] |= {"uid": "9d8c7b6a", "resourceVersion": "77", "generation": 5}
    for device in document["spec"]["devices"]:
        device["capacity"]["memory"]["value"] = "141Gi"
        device["capacity"]["memory"]["requestPolicy"]["validRange"]["step"] = "1Mi"
    served: dict[str, Any] = ResourceSlice.from_dict(document).to_dict()
    return served


def test_the_pool_generation_moves_only_when_the_slice_changes() -> None:
    assert next_generation(None, NODE_SLICE) == 1
    assert next_generation(published(NODE_SLICE, 4), NODE_SLICE) == 4
    fewer = NodeSlice(driver=DRA_DRIVER, node=NODE, pool=NODE, devices=(slice_device(0),))
    assert next_generation(published(NODE_SLICE, 4), fewer) == 5


def test_a_slice_without_the_digest_or_of_another_pool_gets_a_new_generation() -> None:
    unmarked = published(NODE_SLICE, 2)
    unmarked["metadata"]["annotations"].clear()
    assert next_generation(unmarked, NODE_SLICE) == 3
    moved = NodeSlice(driver=DRA_DRIVER, node=NODE, pool="another-pool", devices=NODE_SLICE.devices)
    existing = published(NODE_SLICE, 2)
    existing["metadata"]["annotations"][CONTENT_ANNOTATION] = slice_digest(moved)
    assert next_generation(existing, moved) == 3


def test_a_result_of_a_request_the_claim_does_not_ask_is_refused() -> None:
    def edit(document: dict[str, Any]) -> None:
        document["status"]["allocation"]["devices"]["results"][0]["request"] = "other"

    with pytest.raises(ClaimRefusedError) as refused:
        claim_allocation(claim(edit), REF, driver=DRA_DRIVER, node=NODE)
    assert str(refused.value).endswith(
        "its allocation names request `other` (device gpu-0), which the claim does not ask (gpu, whole): the "
        "allocation is not this claim's"
    )


def test_a_subrequest_of_a_request_with_alternatives_is_asked() -> None:
    def edit(document: dict[str, Any]) -> None:
        document["spec"]["devices"]["requests"][0] = {
            "name": "gpu",
            "firstAvailable": [
                {"name": "big", "deviceClassName": DRA_DRIVER},
                {"name": "small", "deviceClassName": "x"},
            ],
        }
        document["status"]["allocation"]["devices"]["results"][0]["request"] = "gpu/small"

    (device, *_) = claim_allocation(claim(edit), REF, driver=DRA_DRIVER, node=NODE).devices
    assert device.request == "gpu/small"


def test_a_device_with_less_than_a_step_left_offers_its_value_without_a_policy_and_its_taints() -> None:
    full = slice_device(0)
    full = msgspec.structs.replace(
        full,
        memory=CapacityPolicy(value=0, default=0, minimum=MIB, maximum=0, step=MIB),
        taints=(DeviceTaint(key="mps.mpsagent.io/no-memory-left", value="x", effect="NoSchedule", added=1764864026.7),),
    )
    node_slice = NodeSlice(driver=DRA_DRIVER, node=NODE, pool=NODE, devices=(full,))
    document = resource_slice(node_slice, generation=1, node_uid="u")
    (device,) = document["spec"]["devices"]
    assert device["capacity"]["memory"] == {"value": "0"}
    assert device["taints"] == [
        {
            "key": "mps.mpsagent.io/no-memory-left",
            "value": "x",
            "effect": "NoSchedule",
            "timeAdded": "2025-12-04T16:00:26Z",
        }
    ]
    kubernetes_validate.validate(document, "1.34", strict=True)


def test_a_slice_with_taints_holds_at_most_64_devices() -> None:
    taint = DeviceTaint(key="mps.mpsagent.io/unhealthy", value="x", effect="NoSchedule", added=0)
    devices = tuple(msgspec.structs.replace(slice_device(0), taints=(taint,)) for _ in range(65))
    with pytest.raises(
        KubeApiError, match="65 devices, more than the 64 a ResourceSlice holds when a device has taints"
    ):
        resource_slice(NodeSlice(driver=DRA_DRIVER, node=NODE, pool=NODE, devices=devices), generation=1, node_uid="u")
