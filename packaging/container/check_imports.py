"""Run by the image build (packaging/container/Dockerfile) with the image's interpreter, writing no bytecode
(`python -B`): imports every module of the agent, what its dependencies import only once the agent runs (anyio's
event loop backend, httpx2's transport) and every extension module left in the standard library, so that a module
that does not import in the image, or a shared library the image lacks, fails the build."""

import importlib
import pkgutil
import sys
from pathlib import Path

import anyio
import anyio.lowlevel

import mpsagent

failed: list[str] = []


def check(name: str) -> None:
    try:
        importlib.import_module(name)
    except Exception as error:  # every failure is listed, then the build fails
        failed.append(f"{name}: {error!r}")


for module in pkgutil.walk_packages(mpsagent.__path__, "mpsagent."):
    check(module.name)


async def idle() -> None:
    await anyio.lowlevel.checkpoint()


anyio.run(idle)  # the event loop's backend (anyio._backends._asyncio)
for name in ("httpcore2", "truststore"):  # httpx2's transport, imported on the first request to the API server
    check(name)
dynload = Path(sys.base_prefix, "lib", f"python{sys.version_info.major}.{sys.version_info.minor}", "lib-dynload")
for path in sorted(dynload.glob("*.so")):
    check(path.name.split(".")[0])
if failed:
    sys.exit("modules that do not import in the image:\n" + "\n".join(failed))
print(f"{len(sys.modules)} modules imported")
