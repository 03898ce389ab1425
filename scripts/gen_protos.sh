#!/bin/sh
# Regenerates mpsagent/_proto from protos/ with the pinned betterproto2 compiler.
# Usage: scripts/gen_protos.sh [OUT_DIR]   (default: mpsagent/_proto)
set -eu
cd "$(dirname "$0")/.."
out=${1:-mpsagent/_proto}
rm -rf "$out"
mkdir -p "$out"
"${PYTHON:-python3}" -m grpc_tools.protoc -I protos \
  --python_betterproto2_out="$out" \
  --python_betterproto2_opt=client_generation=async,server_generation=async \
  protos/deviceplugin/v1beta1/api.proto protos/podresources/v1/api.proto
