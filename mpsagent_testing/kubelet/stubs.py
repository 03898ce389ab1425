"""Generates grpcio stubs for the kubelet APIs from the repository's protos/ (linked here as `protos`, so that an
installed copy of the test support carries them) into `_generated/` beside this file, and imports them."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

from grpc_tools import protoc

PROTO_DIR = Path(__file__).with_name("protos")
OUT = Path(__file__).with_name("_generated")
PROTOS = (
    "deviceplugin/v1beta1/api.proto",
    "podresources/v1/api.proto",
    "dra/v1/api.proto",
    "pluginregistration/v1/api.proto",
    "dra_health/v1alpha1/api.proto",
    "dra_health/v1/api.proto",
)
_MODULES = ("api_pb2", "api_pb2_grpc")


def _generate() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for proto in PROTOS:
        package = OUT / Path(proto).parent
        source = PROTO_DIR / proto
        target = package / "api_pb2_grpc.py"
        if target.exists() and target.stat().st_mtime > source.stat().st_mtime:
            continue
        code = protoc.main(["protoc", f"-I{PROTO_DIR}", f"--python_out={OUT}", f"--grpc_python_out={OUT}", str(source)])
        if code != 0:
            raise RuntimeError(f"protoc failed for {proto}")


def _modules(*protos: str) -> tuple[ModuleType, ...]:
    """Each proto's message module and gRPC module, in turn."""
    _generate()
    if str(OUT) not in sys.path:
        sys.path.insert(0, str(OUT))
    packages = [str(Path(proto).parent).replace("/", ".") for proto in protos]
    return tuple(importlib.import_module(f"{package}.{module}") for package in packages for module in _MODULES)


def load() -> tuple[ModuleType, ModuleType, ModuleType, ModuleType]:
    """(deviceplugin pb2, deviceplugin grpc, podresources pb2, podresources grpc)"""
    dp, dp_g, pr, pr_g = _modules(PROTOS[0], PROTOS[1])
    return dp, dp_g, pr, pr_g


def load_dra() -> tuple[ModuleType, ModuleType, ModuleType, ModuleType]:
    """(DRA v1 pb2, DRA v1 grpc, plugin registration v1 pb2, plugin registration v1 grpc)"""
    dra, dra_g, reg, reg_g = _modules(PROTOS[2], PROTOS[3])
    return dra, dra_g, reg, reg_g


def load_dra_health() -> tuple[ModuleType, ModuleType, ModuleType, ModuleType]:
    """(DRA health v1alpha1 pb2, DRA health v1alpha1 grpc, DRA health v1 pb2, DRA health v1 grpc)"""
    alpha, alpha_g, health, health_g = _modules(PROTOS[4], PROTOS[5])
    return alpha, alpha_g, health, health_g


dp_pb2, dp_grpc, pr_pb2, pr_grpc = load()
dra_pb2, dra_grpc, reg_pb2, reg_grpc = load_dra()
health_alpha_pb2, health_alpha_grpc, health_pb2, health_grpc = load_dra_health()
