"""mpsagent: shares NVIDIA GPUs between Kubernetes pods through MPS, one agent per node."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("mpsagent")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"
