"""The packaging for its tests and the bench: what the packaged manifests must hold, for the tests of both forms
(kustomize's `packaging/kubernetes` and the Helm chart): the DRA driver's RBAC rules; and the scripts under
packaging/ as modules (`script`), which `packaging` being no package (and a PyPI package's name) keeps from an
import by name."""

from __future__ import annotations

import functools
import importlib.util
import sys
from types import ModuleType

from mpsagent_testing.repo import ROOT

DRA_RULES = [
    {
        "apiGroups": ["resource.k8s.io"],
        "resources": ["resourceslices"],
        "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"],
    },
    {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": ["resource.k8s.io"], "resources": ["devicetaintrules"], "verbs": ["list", "watch"]},
    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]},
    # A control-socket holder the agent ends is told on its pod: found by its UID among the node's pods.
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
]
"""The ClusterRole `mpsagent-dra`'s rules, exactly."""


@functools.cache
def script(path: str) -> ModuleType:
    """The script at packaging/`path` (`dashboard.py`, `binary/glibc_floor.py`) as a module, loaded once from the
    checkout's file; nobody's sys.path changes."""
    file = ROOT / "packaging" / path
    name = f"mpsagent_packaging_{file.stem}"
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec is not None and spec.loader is not None, file
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # where its dataclasses look their module up
    spec.loader.exec_module(module)
    return module
