"""A bad value of a setting with fixed choices names the flag, the environment variable and the config key, from
whichever of the three it came."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mpsagent_testing.repo import H100_NODE, ROOT

CONFIG = """version: v1
sharing:
  mps:
    resources:
    - name: nvidia.com/gpu
      replicas: 4
"""

SETTINGS = [
    ("--log-level", "LOG_LEVEL", "logLevel", "debug, info, warning, error"),
    ("--log-format", "LOG_FORMAT", "logFormat", "auto, json, console"),
    ("--mps-on-exit", "MPS_ON_EXIT", "mpsOnExit", "keep, quit"),
    ("--mps-daemon", "MPS_DAEMON", "mpsDaemon", "agent, host"),
]


def once(config: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mpsagent",
            "--once",
            "--config-file",
            str(config),
            "--node-snapshot",
            str(H100_NODE),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
        env={"PATH": "/usr/bin:/bin", **(env or {})},
    )


@pytest.mark.parametrize(("flag", "variable", "key", "choices"), SETTINGS)
@pytest.mark.parametrize("source", ["environment", "config file"])
def test_a_bad_choice_names_the_flag_the_variable_and_the_key(
    tmp_path: Path, flag: str, variable: str, key: str, choices: str, source: str
) -> None:
    text = CONFIG + (f"flags:\n  {key}: loud\n" if source == "config file" else "")
    config = tmp_path / "config.yaml"
    config.write_text(text)
    done = once(config, env={variable: "loud"} if source == "environment" else None)
    assert done.returncode == 2
    assert (
        done.stderr
        == f"mpsagent: error: {flag} (env {variable}, config flags.{key}) must be one of {choices}; not `loud`\n"
    )


def test_a_long_bad_choice_is_not_echoed_whole(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG)
    done = once(config, env={"MPS_DAEMON": "x" * 100_000})
    assert done.returncode == 2
    assert len(done.stderr) < 300
