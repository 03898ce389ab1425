#!/bin/sh
# Makes a Debian base image on the build host with debootstrap, for hosts that cannot pull `debian:bookworm-slim`
# (no access to Docker Hub, only to Debian's package mirrors). The tree is a `minbase` one, trimmed as Debian's
# slim image is (no documentation but the copyrights, no manual pages or translations, and dpkg told to keep them
# out), with the slim image's deb822 sources (`main`, the release, its updates and security). Run as root:
#
#   packaging/container/debian-base.sh                      # -> localhost/mpsagent-debian:bookworm-slim
#   podman build --build-arg BASE_IMAGE=localhost/mpsagent-debian:bookworm-slim ...
#
# Environment: DEBIAN_RELEASE (bookworm), DEBIAN_MIRROR (http://deb.debian.org/debian), DEBIAN_SECURITY_MIRROR
# (http://deb.debian.org/debian-security), IMAGE (localhost/mpsagent-debian:<release>-slim), CACHE_DIR
# (/var/cache/mpsagent-image). The tree is kept as a tarball in CACHE_DIR and imported into podman's image store
# only when the image is not there, so a second run takes a second; remove the tarball to refresh it.
set -eu
release=${DEBIAN_RELEASE:-bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
security=${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
image=${IMAGE:-localhost/mpsagent-debian:$release-slim}
cache=${CACHE_DIR:-/var/cache/mpsagent-image}
if [ "$(id -u)" != 0 ]; then
  echo "debian-base.sh: run as root (debootstrap and the image store need it)" >&2
  exit 2
fi
for tool in podman debootstrap; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "debian-base.sh: $tool is not installed (scripts/install-system-deps.sh installs it)" >&2
    exit 2
  fi
done
# A changed recipe (this script) or release makes a new tree: both name the tarball and label the image.
recipe=$(sha256sum <"$0" | cut -c1-16)-$release
label=org.mpsagent.base-recipe
if [ "$(podman image inspect --format "{{index .Labels \"$label\"}}" "$image" 2>/dev/null)" = "$recipe" ]; then
  echo "$image"
  exit 0
fi
tarball="$cache/debian-slim-$recipe.tar"
if [ ! -s "$tarball" ]; then
  mkdir -p "$cache"
  tree=$(mktemp -d "$cache/tree.XXXXXX")
  trap 'rm -rf "$tree" "$tarball.part"' EXIT
  debootstrap --variant=minbase "$release" "$tree" "$mirror" >&2
  # As the slim image: dpkg keeps documentation, manual pages and translations out of later installs too.
  cat >"$tree/etc/dpkg/dpkg.cfg.d/slim" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/lintian/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/locale/*
EOF
  # As the slim image: apt keeps no package caches or downloaded packages, compressed lists, no translations.
  cat >"$tree/etc/apt/apt.conf.d/slim" <<'EOF'
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Acquire::GzipIndexes "true";
Acquire::Languages "none";
Apt::AutoRemove::SuggestsImportant "false";
EOF
  find "$tree/usr/share/doc" -mindepth 1 ! -type d ! -name copyright -delete
  rm -rf "$tree/usr/share/man/"* "$tree/usr/share/groff/"* "$tree/usr/share/info/"* "$tree/usr/share/lintian/"* \
    "$tree/usr/share/linda/"* "$tree/usr/share/locale/"*
  rm -f "$tree/etc/apt/sources.list"
  cat >"$tree/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: $mirror
Suites: $release $release-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: $security
Suites: $release-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  rm -rf "$tree/var/lib/apt/lists/"* "$tree/var/cache/apt/"*.bin "$tree/var/cache/apt/archives/"*.deb \
    "$tree/var/log/"*.log "$tree/var/log/apt/"*
  tar --numeric-owner --xattrs -C "$tree" -cf "$tarball.part" .
  rm -f "$cache"/debian-slim-*.tar
  mv "$tarball.part" "$tarball"
  rm -rf "$tree"
  trap - EXIT
fi
podman import --change 'CMD ["bash"]' --change "LABEL $label=$recipe" "$tarball" "$image" >/dev/null
echo "$image"
