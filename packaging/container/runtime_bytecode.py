"""Run by the image build (packaging/container/Dockerfile) with the image's interpreter: imports every module of the
agent, and what its dependencies import only once the agent runs, so that Python writes the bytecode of exactly
those modules (standard library and virtual environment) into the image. The build leaves every other module
without bytecode (it is compiled when first imported, if ever), which keeps the image small; and a module that
does not import fails the build."""

import importlib
import pkgutil
import sys

import anyio
import anyio.lowlevel

import mpsagent

failed = []
for module in pkgutil.walk_packages(mpsagent.__path__, "mpsagent."):
    try:
        importlib.import_module(module.name)
    except Exception as error:  # every failure is listed, then the build fails
        failed.append(f"{module.name}: {error!r}")
if failed:
    sys.exit("modules that do not import in the image:\n" + "\n".join(failed))


async def idle() -> None:
    await anyio.lowlevel.checkpoint()


anyio.run(idle)  # the event loop's backend (anyio._backends._asyncio)
# httpx2's transport, imported on the first request to the API server
for name in ("httpcore2", "truststore"):
    importlib.import_module(name)
print(f"{len(sys.modules)} modules imported")
