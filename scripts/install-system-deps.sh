#!/bin/sh
# Installs the Debian packages mpsagent's tests need, as root: Python with venv, a C compiler (for the fake
# libnvidia-ml.so.1), and the real nvidia-cuda-mps-control from the `non-free` component, enabled if it is not;
# for the packaging tests: systemd (systemd-analyze), binutils (objdump), prometheus (promtool, for the alert rules
# and the metrics format; its server is not started), podman and debootstrap (the image tests build both images
# from a Debian base made locally) and kubectl (kubernetes-client), unless a kubectl is already installed (another
# package's /usr/bin/kubectl would conflict with Debian's); for the real-node tests (scripts/e2e-cluster): etcd,
# runc, the CNI plugins, a static busybox (the pods' image) and openssl (the node's certificates). The node's
# Kubernetes binaries and containerd 2.x (Debian 12's 1.6 has no CDI) are built from their Go modules with Go 1.21
# or later, which fetches the 1.26 toolchain the build names through the Go module proxy: where no Go 1.21+ is on
# PATH (Debian 12's own golang is 1.19), golang-1.23-go from bookworm-backports, enabled if it is not; it installs
# into /usr/lib/go-1.23/bin, on no PATH, where scripts/e2e-cluster finds it.
# APT_ETC (default /etc/apt) is where apt's sources are; tests/tools/test_install_system_deps.py points it at a copy.
set -eu
APT_ETC="${APT_ETC:-/etc/apt}"
if [ "$(id -u)" != 0 ]; then
  echo "install-system-deps.sh: run as root (it uses apt-get)" >&2
  exit 2
fi
enable_non_free() {
  if [ -f "$APT_ETC/sources.list.d/debian.sources" ]; then
    sed -i '/^Components:/{/non-free\( \|$\)/!s/$/ non-free/}' "$APT_ETC/sources.list.d/debian.sources"
  fi
  if [ -f "$APT_ETC/sources.list" ]; then
    sed -i '/^deb .*debian/{/ non-free\( \|$\)/!s/$/ non-free/}' "$APT_ETC/sources.list"
  fi
}
go_1_21_on_path() {
  command -v go >/dev/null 2>&1 || return 1
  minor="$(GOTOOLCHAIN=local go version 2>/dev/null | sed -n 's/.*go1\.\([0-9][0-9]*\).*/\1/p')"
  [ -n "$minor" ] && [ "$minor" -ge 21 ]
}
# bookworm-backports main from the machine's own Debian mirror, written as its Debian source is (deb822 or one
# line), unless a source names bookworm-backports already.
enable_backports() {
  sources="$APT_ETC/sources.list.d"
  if grep -qs '^[^#]*bookworm-backports' "$APT_ETC/sources.list" "$sources"/*.list "$sources"/*.sources; then
    return
  fi
  deb822="$sources/debian.sources"
  if [ -f "$deb822" ]; then
    uri="$(sed -n 's/^URIs: *\([^ ]*\).*/\1/p' "$deb822" | grep -v -- '-security' | head -n 1)"
    signed_by="$(sed -n 's/^Signed-By: *\(.*\)/\1/p' "$deb822" | head -n 1)"
    {
      echo "Types: deb"
      echo "URIs: ${uri:-http://deb.debian.org/debian}"
      echo "Suites: bookworm-backports"
      echo "Components: main"
      if [ -n "$signed_by" ]; then echo "Signed-By: $signed_by"; fi
    } >"$sources/bookworm-backports.sources"
  else
    uri="$(sed -n 's/^deb \(\[[^]]*\] \)\{0,1\}\([^ ]*\) bookworm .*/\2/p' "$APT_ETC/sources.list" | head -n 1)"
    echo "deb ${uri:-http://deb.debian.org/debian} bookworm-backports main" >"$sources/bookworm-backports.list"
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
if ! go_1_21_on_path; then
  enable_backports
  packages="$packages golang-1.23-go"
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
# shellcheck disable=SC2086  # a list of package names
apt-get install -y -q --no-install-recommends $packages
