"""What the packaged manifests must hold, for the tests of both forms (kustomize's `packaging/kubernetes` and the
Helm chart): the DRA driver's RBAC rules."""

from __future__ import annotations

DRA_RULES = [
    {
        "apiGroups": ["resource.k8s.io"],
        "resources": ["resourceslices"],
        "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"],
    },
    {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]},
    # A control-socket holder the agent ends is told on its pod: found by its UID among the node's pods.
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
]
"""The ClusterRole `mpsagent-dra`'s rules, exactly."""
