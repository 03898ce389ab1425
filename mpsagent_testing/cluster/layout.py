"""The e2e node's pinned versions and paths: the build cache, the node's state, its sockets and its logs."""

from __future__ import annotations

from pathlib import Path

KUBERNETES_VERSION = "v1.36.3"
"""The newest 1.36 patch release on the Go module proxy: the first release with DRA consumable capacity (KEP-5075)
and extended resources through DRA (KEP-5004) in beta, on by default, for the DRA driver that builds on this node.
The staging modules it builds against are the same patch release (`gomod/go.mod`)."""
HELM_VERSION = "v3.22.0"
CONTAINERD_VERSION = "v2.4.2"
"""containerd 2.x applies CDI device requests (Debian 12's 1.6 does not), which DRA needs; built from its module with
its shim and ctr. runc stays Debian's."""

COMMANDS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kubectl")
CONTAINERD_COMMANDS = ("containerd", "containerd-shim-runc-v2", "ctr")

CACHE = Path("/var/cache/mpsagent-e2e") / KUBERNETES_VERSION
"""Built once and kept: `bin/` (the commands, containerd and helm) and `images/` (image archives). Removing it
rebuilds."""
BIN = CACHE / "bin"
IMAGES = CACHE / "images"

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
