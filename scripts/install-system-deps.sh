#!/bin/sh
# Installs the Debian packages mpsagent's tests need, as root: Python with venv, a C compiler (for the fake
# libnvidia-ml.so.1), and the real nvidia-cuda-mps-control from the `non-free` component, enabled if it is not;
# for the packaging tests: systemd (systemd-analyze), binutils (objdump), prometheus (promtool, for the alert rules
# and the metrics format; its server is not started), podman and debootstrap (the image tests build both images
# from a Debian base made locally) and kubectl (kubernetes-client), unless a kubectl is already installed (another
# package's /usr/bin/kubectl would conflict with Debian's); for the real-node tests (scripts/e2e-cluster): etcd,
# runc, the CNI plugins, a static busybox (the pods' image) and openssl (the node's certificates). The node's
# Kubernetes binaries and containerd 2.x (Debian 12's 1.6 has no CDI) are built from their Go modules: Go 1.21 or
# later must be on PATH (Debian 12's own golang is 1.19; a newer Go fetches the 1.26 toolchain the build names
# through the Go module proxy).
set -eu
if [ "$(id -u)" != 0 ]; then
  echo "install-system-deps.sh: run as root (it uses apt-get)" >&2
  exit 2
fi
enable_non_free() {
  if [ -f /etc/apt/sources.list.d/debian.sources ]; then
    sed -i '/^Components:/{/non-free\( \|$\)/!s/$/ non-free/}' /etc/apt/sources.list.d/debian.sources
  fi
  if [ -f /etc/apt/sources.list ]; then
    sed -i '/^deb .*debian/{/ non-free\( \|$\)/!s/$/ non-free/}' /etc/apt/sources.list
  fi
}
if ! command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
  enable_non_free
fi
packages="python3 python3-venv python3-dev gcc libc6-dev nvidia-cuda-mps systemd binutils prometheus podman debootstrap"
packages="$packages etcd-server runc containernetworking-plugins busybox-static openssl"
if ! command -v kubectl >/dev/null 2>&1; then
  packages="$packages kubernetes-client"
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
# shellcheck disable=SC2086  # a list of package names
apt-get install -y -q --no-install-recommends $packages
