"""The e2e node's pinned versions and paths: the build cache, the node's state, its sockets and its logs. Which
Kubernetes release the node runs is chosen by `MPSAGENT_E2E_KUBERNETES` (docs/e2e.md), read here, so that
`scripts/e2e-cluster`, the e2e tests and the bench all run the same one."""

from __future__ import annotations

import os
from pathlib import Path

KUBERNETES_VERSIONS = ("v1.37.2", "v1.36.3")
"""The Kubernetes releases the node builds and runs, the default first: for each minor release, its newest patch
release on the Go module proxy, built from that minor's wrapper module `gomod/v1.<minor>/` (`k8s.io/kubernetes` with
its staging modules replaced by their published releases of the same patch). 1.37 is the current release (DRA's
device taints and extended resources through DRA GA, the kubelet's health client asking for `v1` of
`DRAResourceHealth` first); 1.36 the one before it, the first with DRA consumable capacity (KEP-5075) and extended
resources through DRA (KEP-5004) in beta, on by default."""
VERSION_VARIABLE = "MPSAGENT_E2E_KUBERNETES"
KUBERNETES_VERSION = os.environ.get(VERSION_VARIABLE) or KUBERNETES_VERSIONS[0]
"""The release this process builds and runs: `MPSAGENT_E2E_KUBERNETES` when set (`build` refuses one that is not in
KUBERNETES_VERSIONS, naming those that are), else the default."""
HELM_VERSION = "v3.22.0"
CONTAINERD_VERSION = "v2.4.2"
"""containerd 2.x applies CDI device requests (Debian 12's 1.6 does not), which DRA needs; built from its module with
its shim and ctr. runc stays Debian's."""

COMMANDS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kubectl")
CONTAINERD_COMMANDS = ("containerd", "containerd-shim-runc-v2", "ctr")
TOOLS = ("helm", *CONTAINERD_COMMANDS)
"""The node's other built commands, the same for every Kubernetes release."""

CACHE_ROOT = Path("/var/cache/mpsagent-e2e")
"""Built once and kept; removing a folder of it rebuilds what it held, and nothing else."""
CACHE = CACHE_ROOT / KUBERNETES_VERSION
"""One Kubernetes release's commands (`bin/`), so that switching releases rebuilds neither."""
BIN = CACHE / "bin"
TOOLS_BIN = CACHE_ROOT / "tools" / "bin"
"""helm and containerd (with its shim and ctr), built once for every release."""
IMAGES = CACHE_ROOT / "images"
"""The pause and busybox image archives, made once for every release."""

STATE = Path("/var/lib/mpsagent-e2e")
"""The node's own files: certificates, tokens, configs, etcd's data, containerd's root, logs. `down` removes it."""
RUN = Path("/run/mpsagent-e2e")
"""Sockets and containerd's state. `down` removes it."""
LOGS = STATE / "logs"
PIDS = STATE / "pids.json"
KUBECONFIG = STATE / "admin.kubeconfig"
CONTAINERD_SOCKET = RUN / "containerd.sock"
CDI_SPEC_DIRS = (Path("/etc/cdi"), Path("/var/run/cdi"))
"""Where containerd reads CDI specs (its defaults)."""

KUBELET_ROOT = Path("/var/lib/kubelet")
"""The kubelet's standard root, so an agent started with its defaults finds the kubelet's sockets."""
DEVICE_PLUGINS = KUBELET_ROOT / "device-plugins"
POD_RESOURCES_SOCKET = KUBELET_ROOT / "pod-resources" / "kubelet.sock"

API_PORT = 6443
ETCD_PORT = 2379
SERVICE_CIDR = "198.51.100.0/24"
"""A documentation range, neither private nor anyone's: no traffic goes to it (there is no kube-proxy), but the API
server needs one."""

BUSYBOX_IMAGE = "mpsagent-e2e.local/busybox:1"
PAUSE_IMAGE = "mpsagent-e2e.local/pause:1"
