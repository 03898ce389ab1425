#!/bin/sh
# Regenerates mpsagent/_proto from protos/:
# - betterproto2 (pinned compiler) for the kubelet APIs: the device-plugin registration and pod-resources clients
#   use it, and so do the DRA plugin's services (mpsagent.dra: the kubelet's plugin registry and DRAPlugin v1);
# - the upb `protobuf` runtime's code for the device plugin API under upb/: the DevicePlugin service, the hot path,
#   uses it (betterproto2 takes 5 ms to parse a 768-ID request that upb parses in 0.02 ms; docs/performance.md).
# Usage: scripts/gen_protos.sh [OUT_DIR]   (default: mpsagent/_proto)
set -eu
cd "$(dirname "$0")/.."
out=${1:-mpsagent/_proto}
rm -rf "$out"
mkdir -p "$out/upb"
"${PYTHON:-python3}" -m grpc_tools.protoc -I protos \
  --python_betterproto2_out="$out" \
  --python_betterproto2_opt=client_generation=async,server_generation=async \
  protos/deviceplugin/v1beta1/api.proto protos/podresources/v1/api.proto \
  protos/dra/v1/api.proto protos/dra_health/v1/api.proto protos/pluginregistration/v1/api.proto
"${PYTHON:-python3}" -m grpc_tools.protoc -I protos --python_out="$out/upb" --pyi_out="$out/upb" \
  protos/deviceplugin/v1beta1/api.proto
for package in "$out/upb" "$out/upb/deviceplugin" "$out/upb/deviceplugin/v1beta1"; do
  : > "$package/__init__.py"
done
