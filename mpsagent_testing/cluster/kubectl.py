"""The tests' way to the node's API server: the cached kubectl with the node's admin kubeconfig, bounded."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable
from typing import Any, TypeVar

from mpsagent_testing import waiting
from mpsagent_testing.cluster.build import binary
from mpsagent_testing.cluster.layout import KUBECONFIG

T = TypeVar("T")
KUBECTL_TIMEOUT_S = 60
API_POLL_S = 0.2


class KubectlError(RuntimeError):
    """kubectl exited non-zero; the message has its command and stderr."""


def run(*args: str, stdin: str | None = None, timeout: float = KUBECTL_TIMEOUT_S, check: bool = True) -> str:
    """`kubectl ARGS` against the node; its stdout. KubectlError when it fails and `check`."""
    done = subprocess.run(
        [str(binary("kubectl")), "--kubeconfig", str(KUBECONFIG), *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if check and done.returncode != 0:
        raise KubectlError(f"kubectl {' '.join(args)}: {done.stderr.strip()[-2000:]}")
    return done.stdout


def get(*args: str) -> Any:
    """`kubectl get ARGS -o json`, decoded."""
    return json.loads(run("get", *args, "-o", "json"))


def apply(manifest: dict[str, Any] | list[dict[str, Any]]) -> None:
    """`kubectl apply` of one object or a list of them."""
    items = manifest if isinstance(manifest, list) else [manifest]
    run("apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))


def wait_for(check: Callable[[], T], timeout: float, what: str) -> T:
    """`waiting.wait_for`, asking the API server at most five times a second (each ask is a kubectl process)."""
    return waiting.wait_for(check, timeout, what, interval=API_POLL_S)


WRITE_VERBS = frozenset({"POST", "PUT", "PATCH", "APPLY", "DELETE", "DELETECOLLECTION"})
_REQUESTS = re.compile(r"^apiserver_request_total\{(?P<labels>[^}]*)\} (?P<value>\S+)$", re.MULTILINE)


def api_writes(resource: str) -> int:
    """How many write requests (create, update, patch, apply, delete) for `resource` the API server has answered
    since it started, by its own `apiserver_request_total` counter."""
    total = 0.0
    for match in _REQUESTS.finditer(run("get", "--raw", "/metrics")):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match["labels"]))
        if labels.get("resource") == resource and labels.get("verb") in WRITE_VERBS:
            total += float(match["value"])
    return int(total)
