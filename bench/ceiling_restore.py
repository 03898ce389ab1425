"""How fast a ceiling changed behind the agent is restored, and what following the daemon's log costs at rest.

    .venv/bin/python bench/ceiling_restore.py                  # about 30 s
    .venv/bin/python bench/ceiling_restore.py --changes 50 --idle-seconds 60

The agent's daemon supervisor (in this process) starts the real `nvidia-cuda-mps-control` for a one-GPU resource
of 4 replicas of 16 GiB and holds the 1-of-4 ceilings (4096M, 25 %); then, one at a time, a "tenant" (a front-end of
its own, as a root process in a client container would) sends a ceiling command the read-back cannot see (the
limit moved within its GiB, or the thread percentage): the time from the tenant's command to the agent's restoring
one, by the daemon's own time stamps in control.log, is the figure. Read-back rounds every `--probe-interval`
seconds (default 3, the agent's default) run meanwhile, as in the agent. Then an idle window: the CPU the process
(the supervisor, its log follower every 0.2 s, its rounds) and its front-ends use, in per cent of one core.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio

from mpsagent.base.config import check_config, parse_config
from mpsagent.base.logs import configure_logging
from mpsagent.base.values import LogFormat, MpsOnExit
from mpsagent.domain.inventory import Inventory
from mpsagent.domain.plan import build_plan
from mpsagent.gpu.snapshot import SnapshotGpuSource
from mpsagent.mps.daemon import DaemonSupervisor
from mpsagent.mps.paths import prepare_directories
from mpsagent_testing.mps.daemon import REAL_BIN, control, restored_after
from mpsagent_testing.node import small_node

CONFIG = "version: v1\nsharing:\n  mps:\n    resources:\n    - name: gpu\n      replicas: 4\n"
RESTORE = ("set_default_device_pinned_mem_limit 0 4096M", "set_default_active_thread_percentage 25")
CHANGES = (
    "set_default_device_pinned_mem_limit 0 {mib}M",  # within the GiB: the read-back prints `4G` all the same
    "set_default_active_thread_percentage {percent}",
)
WAIT_S = 5.0


def children_cpu() -> float:
    times = os.times()
    return times.children_user + times.children_system


async def measure(directory: Path, changes: int, idle_s: float, probe_interval: float) -> None:
    node = SnapshotGpuSource(small_node(directory / "node.json", gpus=1)).discover()
    plan = build_plan(check_config(parse_config(CONFIG, "bench")), node, directory / "mps")
    prepare_directories(plan)
    resource = plan.resources[0]
    log = resource.log_directory / "control.log"
    supervisor = DaemonSupervisor(
        resource=resource,
        inventory=Inventory(resource),
        gpu_source=SnapshotGpuSource(directory / "node.json"),
        control_bin=str(REAL_BIN),
        on_exit=MpsOnExit.QUIT,
        probe_interval_s=probe_interval,
    )
    supervisor.want_ceilings(resource.shares.smallest_caps())
    async with anyio.create_task_group() as tg:
        await tg.start(supervisor.run)
        took = []
        for i in range(changes):
            template, restore = CHANGES[i % 2], RESTORE[i % 2]
            changed = template.format(mib=4096 - 1 - i % 500, percent=30 + i % 60)
            # A tenant's change, sent again while the agent's own session is open: it must reach the daemon.
            await anyio.to_thread.run_sync(control, resource.pipe_directory, changed)
            with anyio.fail_after(WAIT_S):
                # The file is the only signal there is: polled.
                while (seconds := restored_after(log, changed, restore)) is None:  # noqa: ASYNC110
                    await anyio.sleep(0.02)
            took.append(seconds)
            await anyio.sleep(0.3)  # the restore's own session ends before the next change
        status = supervisor.status()
        started, cpu, front_ends = time.monotonic(), time.process_time(), children_cpu()
        await anyio.sleep(idle_s)
        wall = time.monotonic() - started
        own, spawned = time.process_time() - cpu, children_cpu() - front_ends
        tg.cancel_scope.cancel()
    took.sort()
    print(f"ceiling changes: {changes}, counted {status.cap_tamper} ({status.cap_tamper_in_log} seen in the log)")
    print(
        "restored after (s, the daemon's clock): "
        f"min {took[0]:.3f}  median {statistics.median(took):.3f}  p90 {took[int(len(took) * 0.9)]:.3f}  "
        f"max {took[-1]:.3f}"
    )
    print(
        f"idle {wall:.0f} s (probe interval {probe_interval:g} s): this process {100 * own / wall:.2f} % of a core, "
        f"its front-ends {100 * spawned / wall:.2f} %"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--changes", type=int, default=40)
    parser.add_argument("--idle-seconds", type=float, default=20.0)
    parser.add_argument("--probe-interval", type=float, default=3.0)
    args = parser.parse_args()
    if REAL_BIN is None:
        print("nvidia-cuda-mps-control is not installed: run scripts/install-system-deps.sh", file=sys.stderr)
        return 2
    configure_logging(LogFormat.CONSOLE, "warning")  # the restore warnings only
    with tempfile.TemporaryDirectory(prefix="mpb", dir="/tmp") as directory:
        anyio.run(measure, Path(directory), args.changes, args.idle_seconds, args.probe_interval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
