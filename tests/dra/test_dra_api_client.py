"""The API server adapter's calls against a mock transport (the real server is the e2e tests'): the requests it
makes, the answers it turns into the domain's Structs, every failure one KubeApiError with the HTTP status, and
the credentials `connect` accepts or refuses with a message that says what to do."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest

from mpsagent.base.errors import ClaimRefusedError, KubeApiError, UsageError
from mpsagent.domain.claims import DRA_DRIVER, ClaimRef
from mpsagent.dra import api
from mpsagent.dra.api import connect
from mpsagent_testing.kube_api import CLAIM, NODE, NODE_OBJECT, REF, Handler, kube_api, status


class Server:
    """Answers by (method, path); records each request."""

    def __init__(self, answers: dict[tuple[str, str], Any]) -> None:
        self.answers = answers
        self.requests: list[httpx2.Request] = []

    async def __call__(self, request: httpx2.Request) -> httpx2.Response:
        self.requests.append(request)
        answer = self.answers.get((request.method, request.url.path), status(404, "not found"))
        return answer if isinstance(answer, httpx2.Response) else httpx2.Response(200, json=answer)

    def calls(self) -> list[str]:
        return [f"{r.method} {r.url.path}" for r in self.requests]


@pytest.mark.anyio
async def test_read_claim_gets_the_claim_and_converts_it() -> None:
    server = Server({("GET", "/apis/resource.k8s.io/v1/namespaces/team-a/resourceclaims/trainer-gpu"): CLAIM})
    kube = kube_api(server)
    try:
        allocation = await kube.read_claim(REF, driver=DRA_DRIVER, node=NODE)
    finally:
        await kube.close()
    assert [d.device for d in allocation.devices] == ["gpu-0", "gpu-1"]
    assert server.requests[0].headers["authorization"] == "Bearer t0ken"


@pytest.mark.anyio
async def test_a_re_created_claim_is_refused_as_such() -> None:
    kube = kube_api(Server({("GET", "/apis/resource.k8s.io/v1/namespaces/team-a/resourceclaims/trainer-gpu"): CLAIM}))
    ref = ClaimRef(namespace="team-a", name="trainer-gpu", uid="11111111-0000-4000-8000-000000000000")
    with pytest.raises(ClaimRefusedError, match="it was deleted and re-created"):
        await kube.read_claim(ref, driver=DRA_DRIVER, node=NODE)
    await kube.close()


@pytest.mark.anyio
async def test_a_missing_claim_is_an_api_error_with_its_status() -> None:
    message = 'resourceclaims.resource.k8s.io "trainer-gpu" not found'
    kube = kube_api(
        Server({("GET", "/apis/resource.k8s.io/v1/namespaces/team-a/resourceclaims/trainer-gpu"): status(404, message)})
    )
    with pytest.raises(KubeApiError) as caught:
        await kube.read_claim(REF, driver=DRA_DRIVER, node=NODE)
    await kube.close()
    assert caught.value.status == 404
    assert str(caught.value) == f"reading ResourceClaim team-a/trainer-gpu: {message} (HTTP 404)"


async def refuse_connection(request: httpx2.Request) -> httpx2.Response:
    raise httpx2.ConnectError("[Errno 111] Connection refused", request=request)


async def plain_500(request: httpx2.Request) -> httpx2.Response:
    return httpx2.Response(500, text="oops")


async def read_timeout(request: httpx2.Request) -> httpx2.Response:
    raise httpx2.ReadTimeout("timed out", request=request)


async def bare_503(request: httpx2.Request) -> httpx2.Response:
    return httpx2.Response(503)


async def broken_status(request: httpx2.Request) -> httpx2.Response:
    return httpx2.Response(500, content=b"{not json", headers={"Content-Type": "application/json"})


async def garbage(request: httpx2.Request) -> httpx2.Response:
    return httpx2.Response(200, json={"metadata": "not an object"})


@pytest.mark.parametrize(
    ("handler", "expected", "code"),
    [
        (refuse_connection, "[Errno 111] Connection refused", None),
        (plain_500, "Internal Server Error (HTTP 500)", 500),
        (read_timeout, "no answer within 10 s (ReadTimeout)", None),
        (bare_503, "Service Unavailable (HTTP 503)", 503),
        (broken_status, "Internal Server Error (HTTP 500)", 500),
        (garbage, "the answer is not what the API says: Expected `object | null`, got `str` - at `$.metadata`", None),
    ],
)
@pytest.mark.anyio
async def test_every_failure_is_one_api_error(handler: Handler, expected: str, code: int | None) -> None:
    kube = kube_api(handler)
    with pytest.raises(KubeApiError) as caught:
        await kube.read_claim(REF, driver=DRA_DRIVER, node=NODE)
    await kube.close()
    assert str(caught.value) == f"reading ResourceClaim team-a/trainer-gpu: {expected}"
    assert caught.value.status == code


@pytest.mark.anyio
async def test_a_call_is_bounded_whatever_the_server_does(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(api, "CALL_TIMEOUT_S", 0.05)

    async def never(request: httpx2.Request) -> httpx2.Response:
        await anyio.sleep_forever()
        raise AssertionError

    kube = kube_api(never)
    with pytest.raises(
        KubeApiError, match=r"reading ResourceClaim team-a/trainer-gpu: no complete answer within 0.05 s"
    ):
        await kube.read_claim(REF, driver=DRA_DRIVER, node=NODE)
    await kube.close()


@pytest.mark.anyio
async def test_a_missing_node_is_an_api_error_with_its_status() -> None:
    kube = kube_api(Server({("GET", f"/api/v1/nodes/{NODE}"): status(404, 'nodes "node-1" not found')}))
    with pytest.raises(KubeApiError) as caught:
        await kube.node_uid(NODE)
    await kube.close()
    assert str(caught.value) == 'reading Node node-1: nodes "node-1" not found (HTTP 404)'


@pytest.mark.anyio
async def test_the_node_uid_is_read_from_the_node_object() -> None:
    kube = kube_api(Server({("GET", f"/api/v1/nodes/{NODE}"): NODE_OBJECT}))
    assert await kube.node_uid(NODE) == "4f6e3d2c-node"
    await kube.close()


# --- credentials --------------------------------------------------------------------------------------------

HINT = "give --kubeconfig a kubeconfig file, or leave it out and run the agent in a pod with a service account"
KUBECONFIG = {
    "apiVersion": "v1",
    "kind": "Config",
    "current-context": "agent",
    "clusters": [{"name": "local", "cluster": {"server": "https://127.0.0.1:6443", "insecure-skip-tls-verify": True}}],
    "users": [{"name": "agent", "user": {"token": "t0ken"}}],
    "contexts": [{"name": "agent", "context": {"cluster": "local", "user": "agent"}}],
}


@pytest.mark.anyio
async def test_a_kubeconfig_file_connects_without_sending_anything(tmp_path: Path) -> None:
    path = tmp_path / "agent.kubeconfig"
    path.write_text(json.dumps(KUBECONFIG))
    kube = await connect(path)
    await kube.close()


@pytest.mark.anyio
async def test_a_missing_kubeconfig_is_a_usage_error_that_says_what_to_do(tmp_path: Path) -> None:
    path = tmp_path / "missing.kubeconfig"
    with pytest.raises(UsageError) as caught:
        await connect(path)
    assert str(caught.value) == f"--kubeconfig {path}: no such file; {HINT}"


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("[unclosed", "--kubeconfig {path}: "),
        ("[]", "--kubeconfig {path}: is not a usable kubeconfig (not a mapping)"),
        (
            json.dumps({**KUBECONFIG, "current-context": "elsewhere"}),
            "is not a usable kubeconfig (Context 'elsewhere' not found)",
        ),
        (
            json.dumps({k: v for k, v in KUBECONFIG.items() if k != "clusters"}),
            "is not a usable kubeconfig (no entry `clusters`)",
        ),
        (
            json.dumps({**KUBECONFIG, "contexts": [{"name": "agent", "context": {"cluster": "local"}}]}),
            "its current context names no user",
        ),
    ],
)
@pytest.mark.anyio
async def test_a_kubeconfig_that_is_not_usable_is_a_usage_error_naming_it(
    tmp_path: Path, content: str, problem: str
) -> None:
    path = tmp_path / "agent.kubeconfig"
    path.write_text(content)
    with pytest.raises(UsageError) as caught:
        await connect(path)
    assert problem.format(path=path) in str(caught.value)
    assert str(caught.value).startswith(f"--kubeconfig {path}: ")


@pytest.mark.anyio
async def test_a_kubeconfig_whose_certificate_is_missing_is_a_usage_error(tmp_path: Path) -> None:
    path = tmp_path / "agent.kubeconfig"
    cluster = {"server": "https://127.0.0.1:6443", "certificate-authority": str(tmp_path / "ca.crt")}
    path.write_text(json.dumps({**KUBECONFIG, "clusters": [{"name": "local", "cluster": cluster}]}))
    with pytest.raises(UsageError) as caught:
        await connect(path)
    assert (
        str(caught.value) == f"--kubeconfig {path}: its certificate-authority {tmp_path}/ca.crt is not a file; {HINT}"
    )
    cluster["certificate-authority"] = "ca.crt"  # relative: to the kubeconfig's directory
    (tmp_path / "ca.crt").write_text("not a certificate")
    path.write_text(json.dumps({**KUBECONFIG, "clusters": [{"name": "local", "cluster": cluster}]}))
    with pytest.raises(UsageError, match=rf"--kubeconfig {path}: its credentials cannot be used \(.*\); {HINT}"):
        await connect(path)


@pytest.mark.anyio
async def test_no_in_cluster_credentials_is_a_usage_error_that_says_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_PORT", raising=False)
    with pytest.raises(UsageError) as caught:
        await connect(None, service_account=tmp_path)
    assert str(caught.value) == (
        "no --kubeconfig given, and no in-cluster credentials: KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT "
        f"not set; {HINT}"
    )
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    with pytest.raises(UsageError, match=f"no service account token and namespace in {tmp_path} "):
        await connect(None, service_account=tmp_path)


SYSTEM_CAS = Path("/etc/ssl/certs/ca-certificates.crt")


@pytest.mark.anyio
async def test_in_cluster_credentials_connect(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    (tmp_path / "token").write_text("t0ken")
    (tmp_path / "namespace").write_text("mpsagent")
    (tmp_path / "ca.crt").write_text("")
    with pytest.raises(UsageError, match=f"the service account {tmp_path}: its credentials cannot be used"):
        await connect(None, service_account=tmp_path)  # an empty CA file holds no certificate
    if not SYSTEM_CAS.is_file():
        pytest.skip(f"no CA bundle at {SYSTEM_CAS} to stand for the cluster's")
    (tmp_path / "ca.crt").write_bytes(SYSTEM_CAS.read_bytes())
    kube = await connect(None, service_account=tmp_path)
    await kube.close()
