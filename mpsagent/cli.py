"""The command line: the settings' flags (from the table in settings.py), the run modes, and what each does."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import anyio

from mpsagent import __version__
from mpsagent.base.config import resolve_settings, status_mps_root
from mpsagent.base.errors import (
    AgentLockedError,
    ConfigError,
    DaemonError,
    GpuDiscoveryError,
    MpsAgentError,
    SnapshotError,
    UsageError,
)
from mpsagent.base.host import node_name
from mpsagent.base.logs import configure_logging, get_logger
from mpsagent.base.settings import SETTINGS, Settings
from mpsagent.base.values import DraMode
from mpsagent.documents.report import plan_report, render_json, render_text
from mpsagent.documents.status import render_status_text
from mpsagent.documents.status_file import read_status, render_status_json
from mpsagent.domain.plan import NodePlan, build_plan
from mpsagent.gpu.port import GpuSource
from mpsagent.mps.control import offers_multi_user

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_USAGE = 2

log = get_logger("mpsagent")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mpsagent",
        description="Kubernetes device plugin that shares NVIDIA GPUs through MPS. "
        "Flags win over environment variables, which win over the config file's `flags`.",
        argument_default=None,
    )
    add = parser.add_argument
    for entry in SETTINGS.values():
        add(
            entry.flag,
            metavar=entry.metavar,
            choices=[str(choice) for choice in entry.choices] or None,
            type=entry.choice if entry.choices else str,
            help=entry.help_text(),
        )
    add("--once", action="store_true", default=False, help="dry run: print the plan and exit")
    add(
        "--status",
        action="store_true",
        default=False,
        help="print what the running agent is doing (grants and their pods, health, daemons) and exit",
    )
    add(
        "--daemon-host",
        action="store_true",
        default=False,
        help="run only the MPS control daemons of the configured resources, restarting any that exits, for an "
        "agent started with --mps-daemon host",
    )
    add("--output", choices=("text", "json"), help="--once and --status output format (default text)")
    add("--version", action="version", version=f"mpsagent {__version__}")
    return parser


def _gpu_source(settings: Settings) -> GpuSource:
    if settings.node_snapshot is not None:
        from mpsagent.gpu.snapshot import SnapshotGpuSource  # noqa: PLC0415

        return SnapshotGpuSource(settings.node_snapshot)
    from mpsagent.gpu.nvml import NvmlGpuSource  # noqa: PLC0415  (loads libnvidia-ml only when needed)

    return NvmlGpuSource()


def cdi_hook(setting: Path | None) -> tuple[Path | None, str | None]:
    """The agent's CDI hook as the runtime runs it (a bare name: beside the agent's Python), or why there is none."""
    if setting is None:
        return None, "the agent has no CDI hook to set them with (--cdi-hook is empty)"
    path = setting if len(setting.parts) > 1 else Path(sys.executable).parent / setting
    if not (path.is_file() and os.access(path, os.X_OK)):
        return None, f"the agent's CDI hook {path} is not an executable file here (--cdi-hook)"
    return path, None


def _plan(settings: Settings, source: GpuSource) -> tuple[NodePlan, Path | None]:
    node = source.discover()
    hook, missing = cdi_hook(settings.cdi_hook)
    if missing is not None:
        node = node.without_memory_limits(missing)
    return build_plan(settings.sharing, node, settings.mps_root), hook


def run(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.status:
            document = read_status(status_mps_root(vars(args)))
            print(render_status_json(document) if args.output == "json" else render_status_text(document))
            return EXIT_OK
        settings = resolve_settings(vars(args))
        configure_logging(settings.log_format, settings.log_level, settings.library_log_level)
        for warning in settings.sharing.warnings:
            log.warning("config accepted with a warning", problem=warning)
        for key in settings.sharing.ignored_keys:
            log.info("config key ignored", key=key, reason="no meaning for MPS sharing through mpsagent")
        source = _gpu_source(settings)
        plan, hook = _plan(settings, source)
        if settings.once:
            report = plan_report(
                plan,
                control_bin=settings.mps_control_bin,
                manages_compute_mode=source.manages_compute_mode,
                multi_user_offered=offers_multi_user(settings.mps_control_bin),
                dra_node=node_name(settings.node_name) if settings.dra is DraMode.ON else None,
            )
            print(render_json(report) if settings.output == "json" else render_text(report))
            return EXIT_OK
        if settings.daemon_host:
            from mpsagent.supervisor.daemon_host import run_daemon_host  # noqa: PLC0415

            anyio.run(run_daemon_host, settings, plan)
            return EXIT_OK
        from mpsagent.supervisor.app import run_agent  # noqa: PLC0415

        anyio.run(run_agent, settings, plan, source, hook)
        return EXIT_OK
    except (UsageError, ConfigError, SnapshotError) as exc:
        print(f"mpsagent: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (AgentLockedError, GpuDiscoveryError, DaemonError, MpsAgentError) as exc:
        print(f"mpsagent: error: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
