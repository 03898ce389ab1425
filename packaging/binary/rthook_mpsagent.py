"""Runtime hook of the one-file `mpsagent`: runs before the agent's code, in the process that runs Python.

A one-file build runs as two processes: PyInstaller's bootloader, which unpacks the bundle into a temporary
`_MEI*` directory, starts a child and waits for it, and that child, which runs Python. This hook, in the child:

1. Gives the programs that the agent starts (`nvidia-cuda-mps-control`, which starts `nvidia-cuda-mps-server` and
   loads the driver's libcuda) the environment the agent was started with. The bootloader points
   LD_LIBRARY_PATH at the bundle's libraries (libssl, libz, libffi, ...): the MPS programs must load the node's own,
   and must not depend on a directory that is deleted when the agent exits while they keep running. The agent's
   own process is unaffected: the dynamic loader read the variable when it started. Likewise, where the service
   sets TMPDIR only for the bootloader (to unpack outside /tmp), it also sets MPSAGENT_CHILD_TMPDIR to the value
   the children get (empty: none).
2. Makes the kernel SIGKILL this process if the bootloader dies first (e.g. systemd's stop timeout with
   KillMode=process kills only the main PID). Otherwise it would be left running, still holding the per-resource
   locks, and the next agent could not start. The MPS daemon runs in its own session and is not affected.
3. Points WATCHDOG_PID (systemd's watchdog, set to the service's main PID, which is the bootloader) at this
   process, so that the agent, which sends the WATCHDOG=1 pings, sees the watchdog as meant for itself.
"""

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def _parent_is_our_bootloader() -> bool:
    try:
        return os.path.realpath(f"/proc/{os.getppid()}/exe") == os.path.realpath(sys.executable)
    except OSError:
        return False


def _restore_child_environment() -> None:
    original = os.environ.pop("LD_LIBRARY_PATH_ORIG", None)
    if original is not None:
        os.environ["LD_LIBRARY_PATH"] = original
    else:
        os.environ.pop("LD_LIBRARY_PATH", None)
    child_tmpdir = os.environ.pop("MPSAGENT_CHILD_TMPDIR", None)
    if child_tmpdir:
        os.environ["TMPDIR"] = child_tmpdir
    elif child_tmpdir is not None:
        os.environ.pop("TMPDIR", None)


def _die_with_bootloader(parent: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0 and os.getppid() != parent:
        os._exit(1)  # the bootloader died before the request took effect


def _take_over_watchdog(parent: int) -> None:
    if os.environ.get("WATCHDOG_PID") == str(parent):
        os.environ["WATCHDOG_PID"] = str(os.getpid())


_restore_child_environment()
if sys.platform.startswith("linux") and _parent_is_our_bootloader():
    _bootloader = os.getppid()
    _die_with_bootloader(_bootloader)
    _take_over_watchdog(_bootloader)
