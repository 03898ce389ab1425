"""The tests' way to the node's API server: the cached kubectl with the node's admin kubeconfig, bounded."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from typing import Any, TypeVar

from mpsagent_testing.cluster.build import binary
from mpsagent_testing.cluster.layout import KUBECONFIG

T = TypeVar("T")
KUBECTL_TIMEOUT_S = 60


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


def wait_for(check: Callable[[], T | None], timeout: float, what: str, interval: float = 0.2) -> T:
    """Poll `check` until it returns something other than None (or False); TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value is not None and value is not False:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:g} s for {what}")
        time.sleep(interval)
