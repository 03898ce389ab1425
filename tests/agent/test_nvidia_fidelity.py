"""Drop-in fidelity: inputs the NVIDIA device plugin (v0.20.0) accepts or refuses, run through `mpsagent --once`.

Each case is a config drawn from upstream's own tests (`api/config/v1/*_test.go`, `internal/rm/rm_test.go`,
`cmd/mps-control-daemon/mps/device_test.go`, `internal/lm/resource_test.go`), its README, Helm values and GPU
Operator examples, with upstream's outcome and ours. Where they differ, `difference` is the first cell of the row in
docs/migrating.md's "Differences from the NVIDIA plugin" table that gives the reason; the docs test below fails when
a difference has no row there, or a row no case.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from mpsagent_testing.repo import H100_NODE, ROOT

MIGRATING = ROOT / "docs" / "migrating.md"
V100_NODE = """\
driverVersion: "535.183.01"
gpus:
- uuid: GPU-0f2e1d3c-4b5a-6978-8a9b-0c1d2e3f4a5b
  index: 0
  name: Tesla V100-SXM2-32GB
  memoryBytes: 34359738368
  computeCapability: "7.0"
  pciBusId: "00000000:18:00.0"
  numaNode: 0
  migEnabled: false
"""
ACCEPTED = "accepted"

MPS_GPU_4 = "sharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n"


def mps(entries: str, *, version: str = "version: v1\n", extra: str = "") -> str:
    return f"{version}{extra}sharing:\n  mps:\n    resources:\n{entries}"


@dataclass(frozen=True)
class Case:
    """One upstream input. `ours` is a phrase of our output: stdout when accepted (exit 0), the one-line error when
    refused (exit 2)."""

    id: str
    config: str
    upstream: str
    refused: bool
    ours: str
    difference: str | None = None
    node: str | None = None  # a snapshot other than the 8-GPU H100 node


CASES = [
    # --- the same outcome ---
    Case(
        "gpu-operator-mps-example",
        "version: v1\nflags:\n  migStrategy: none\n" + MPS_GPU_4,
        ACCEPTED,
        False,
        "8 GPUs x 4 replicas",
    ),
    Case(
        "readme-mps-10-replicas",
        mps("    - name: nvidia.com/gpu\n      replicas: 10\n"),
        ACCEPTED,
        False,
        "8 GPUs x 10 replicas",
    ),
    Case(
        "helm-values-flags-with-gdrcopy",
        "version: v1\nflags:\n  migStrategy: none\n  failOnInitError: true\n  nvidiaDriverRoot: /\n"
        "  plugin:\n    passDeviceSpecs: false\n    deviceListStrategy: envvar\n    deviceIDStrategy: uuid\n"
        "  gdsEnabled: false\n  mofedEnabled: false\n  gdrcopyEnabled: false\n" + MPS_GPU_4,
        "accepted (gdrcopyEnabled is a flags key since v0.18.0)",
        False,
        "8 GPUs x 4 replicas",
    ),
    Case("version-missing", MPS_GPU_4, "accepted as v1", False, "8 GPUs x 4 replicas"),
    Case("version-v2", "version: v2\n" + MPS_GPU_4, "refused: unknown version", True, "version: `v2` is not supported"),
    Case(
        "devices-integral-float",
        mps("    - name: nvidia.com/gpu\n      replicas: 2\n      devices: 2.0\n"),
        "accepted: a count of 2",
        False,
        "2 GPUs x 2 replicas",
    ),
    Case(
        "devices-count-zero",
        mps("    - name: nvidia.com/gpu\n      replicas: 2\n      devices: 0\n"),
        "refused: a count of devices must be > 0",
        True,
        "a device count must be at least 1",
    ),
    Case(
        "devices-other-string",
        mps("    - name: nvidia.com/gpu\n      replicas: 2\n      devices: some\n"),
        "refused: the only valid string input is 'all'",
        True,
        "sharing.mps.resources[0].devices",
    ),
    Case(
        "replicas-zero",
        mps("    - name: nvidia.com/gpu\n      replicas: 0\n"),
        "refused: number of replicas must be >= 2",
        True,
        "sharing.mps.resources[0].replicas: must be between 1 and 48",
    ),
    Case(
        "replicas-missing",
        mps("    - name: nvidia.com/gpu\n"),
        "refused: no replicas specified",
        True,
        "required key `replicas` is missing",
    ),
    Case(
        "name-missing",
        mps("    - replicas: 2\n"),
        "refused: no resource name specified",
        True,
        "required key `name` is missing",
    ),
    Case(
        "replicas-above-48",
        mps("    - name: nvidia.com/gpu\n      replicas: 49\n"),
        "refused: maximum allowed replicas exceeded: 49 > 48",
        True,
        "must be between 1 and 48",
    ),
    Case(
        "imex-channel-2",
        "version: v1\nimex:\n  channelIDs: [2]\n" + MPS_GPU_4,
        "refused: channelIDs must be [] or [0]",
        True,
        "imex.channelIDs: must be [] or [0], not [2]",
    ),
    Case(
        "imex-channels-0-and-1",
        "version: v1\nimex:\n  channelIDs: [0, 1]\n" + MPS_GPU_4,
        "refused: channelIDs must be [] or [0]",
        True,
        "imex.channelIDs: must be [] or [0]",
    ),
    Case(
        "imex-channel-0-required",
        "version: v1\nimex:\n  channelIDs: [0]\n  required: true\n" + MPS_GPU_4,
        ACCEPTED,
        False,
        "8 GPUs x 4 replicas",
    ),
    Case("imex-empty", "version: v1\nimex:\n  channelIDs: []\n" + MPS_GPU_4, ACCEPTED, False, "8 GPUs x 4 replicas"),
    Case(
        "fail-requests-greater-than-one-false",
        "version: v1\nsharing:\n  mps:\n    failRequestsGreaterThanOne: false\n    resources:\n"
        "    - name: nvidia.com/gpu\n      replicas: 4\n",
        ACCEPTED,
        False,
        "8 GPUs x 4 replicas",
    ),
    Case(
        "rename-by-default",
        "version: v1\nsharing:\n  mps:\n    renameByDefault: true\n    resources:\n"
        "    - name: nvidia.com/gpu\n      replicas: 4\n",
        "accepted: advertised as nvidia.com/gpu.shared",
        False,
        "Resource nvidia.com/gpu.shared",
    ),
    Case(
        "labels-shared-product-and-replicas",
        "version: v1\n" + MPS_GPU_4,
        "gpu.product with -SHARED, gpu.replicas=4 (internal/lm)",
        False,
        "nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3-SHARED\n  nvidia.com/gpu.replicas=4\n",
    ),
    Case(
        "labels-renamed-product-without-suffix",
        "version: v1\nsharing:\n  mps:\n    renameByDefault: true\n    resources:\n"
        "    - name: nvidia.com/gpu\n      replicas: 4\n",
        "a renamed resource's gpu.product has no -SHARED (internal/lm)",
        False,
        "nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3\n",
    ),
    Case(
        "device-id-strategy-index",
        "version: v1\nflags:\n  plugin:\n    deviceIDStrategy: index\n" + MPS_GPU_4,
        ACCEPTED,
        False,
        "8 GPUs x 4 replicas",
    ),
    Case(
        "top-level-resources",
        "version: v1\nresources:\n  gpus:\n  - pattern: '*'\n    name: gpu\n" + MPS_GPU_4,
        "accepted; `resources` ignored with a warning",
        False,
        "8 GPUs x 4 replicas",
    ),
    Case(
        "gpu-name-without-domain",
        mps("    - name: gpu\n      replicas: 4\n"),
        "accepted: nvidia.com/gpu",
        False,
        "Resource nvidia.com/gpu:",
    ),
    # --- documented differences ---
    Case(
        "empty-file",
        "",
        "accepted: no sharing, every GPU advertised whole",
        True,
        "is empty: it must configure sharing.mps.resources",
        difference="an empty file, or one without `sharing.mps`",
    ),
    Case(
        "no-sharing",
        "version: v1\nflags:\n  migStrategy: none\n",
        "accepted: no sharing, every GPU advertised whole",
        True,
        "sharing.mps.resources: no MPS sharing is configured",
        difference="an empty file, or one without `sharing.mps`",
    ),
    Case(
        "rename",
        mps("    - name: nvidia.com/gpu\n      rename: nvidia.com/gpu-mps\n      replicas: 4\n"),
        "accepted; `rename` ignored with a warning (v0.20 advertises nvidia.com/gpu)",
        False,
        "Resource nvidia.com/gpu-mps:",
        difference="`rename`, `devices`",
    ),
    Case(
        "devices-list",
        mps("    - name: nvidia.com/gpu\n      devices: [0, 1]\n      replicas: 4\n"),
        "accepted; `devices` ignored with a warning (v0.20 shares every GPU)",
        False,
        "2 GPUs x 4 replicas",
        difference="`rename`, `devices`",
    ),
    Case(
        "devices-mig-index",
        mps("    - name: nvidia.com/gpu\n      devices: ['0:0']\n      replicas: 4\n"),
        "accepted; `devices` ignored with a warning",
        True,
        "`0:0` is a MIG device; MIG devices cannot be shared through MPS",
        difference="`devices` naming a MIG device",
    ),
    Case(
        "devices-mig-uuid",
        mps(
            "    - name: nvidia.com/gpu\n      devices: [MIG-b1028956-cfa2-0990-bf4a-5da9abb51763]\n      replicas: 2\n"
        ),
        "accepted; `devices` ignored with a warning",
        True,
        "MIG devices cannot be shared through MPS",
        difference="`devices` naming a MIG device",
    ),
    Case(
        "devices-mig-gpu-uuid-gi-ci",
        mps(
            "    - name: nvidia.com/gpu\n      devices: [MIG-GPU-b1028956-cfa2-0990-bf4a-5da9abb51763/3/0]\n"
            "      replicas: 4\n"
        ),
        "accepted; `devices` ignored with a warning",
        True,
        "MIG devices cannot be shared through MPS",
        difference="`devices` naming a MIG device",
    ),
    Case(
        "two-resources-over-every-gpu",
        mps(
            "    - name: nvidia.com/gpu\n      rename: nvidia.com/gpu-a\n      replicas: 2\n"
            "    - name: nvidia.com/gpu\n      rename: nvidia.com/gpu-b\n      replicas: 4\n"
        ),
        "accepted (`rename` and `devices` ignored)",
        True,
        "sharing.mps.resources[1].devices",
        difference="two resources over the same GPU",
    ),
    Case(
        "replicas-20-on-compute-capability-7.0",
        mps("    - name: nvidia.com/gpu\n      replicas: 20\n"),
        "refused: maximum allowed replicas exceeded: 20 > 16 (below compute capability 7.5)",
        False,
        "1 GPU x 20 replicas",
        difference="`replicas` of 17 to 48 on compute capability 7.0 to 7.4",
        node=V100_NODE,
    ),
    Case(
        "replicas-1",
        mps("    - name: nvidia.com/gpu\n      replicas: 1\n"),
        "refused: number of replicas must be >= 2",
        False,
        "8 GPUs x 1 replica",
        difference="`replicas: 1`",
    ),
    Case(
        "name-outside-nvidia-com",
        mps("    - name: example.com/gpu\n      replicas: 4\n"),
        "refused: the name is put under nvidia.com/ and is then no DNS subdomain",
        False,
        "Resource example.com/gpu:",
        difference="resource names",
    ),
    Case(
        "name-uppercase",
        mps("    - name: nvidia.com/GPU\n      replicas: 4\n"),
        "refused: a resource name is a lowercase DNS subdomain",
        False,
        "Resource nvidia.com/GPU:",
        difference="resource names",
    ),
    Case(
        "name-longer-than-63",
        mps(f"    - name: nvidia.com/{'g' * 60}\n      replicas: 4\n"),
        "refused: fully-qualified resource name must be 63 characters or less",
        False,
        f"Resource nvidia.com/{'g' * 60}:",
        difference="resource names",
    ),
    Case(
        "name-not-gpu",
        mps("    - name: nvidia.com/mps-gpu\n      replicas: 4\n"),
        "accepted, but nothing is shared: only nvidia.com/gpu devices are replicated",
        False,
        "Resource nvidia.com/mps-gpu:",
        difference="a `name` other than `nvidia.com/gpu`",
    ),
    Case(
        "device-list-strategy-volume-mounts",
        "version: v1\nflags:\n  plugin:\n    deviceListStrategy: volume-mounts\n" + MPS_GPU_4,
        ACCEPTED,
        True,
        "flags.plugin.deviceListStrategy: `volume-mounts` is not supported",
        difference="`deviceListStrategy` other than `envvar`, `cdi-cri`",
    ),
    Case(
        "device-list-strategy-two",
        "version: v1\nflags:\n  plugin:\n    deviceListStrategy: [envvar, cdi-annotations]\n" + MPS_GPU_4,
        ACCEPTED,
        True,
        "give exactly one strategy",
        difference="`deviceListStrategy` other than `envvar`, `cdi-cri`",
    ),
    Case(
        "time-slicing",
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n",
        "accepted: time-sliced replicas",
        True,
        "sharing.timeSlicing: time-slicing is not supported",
        difference="`sharing.timeSlicing`",
    ),
    Case(
        "pinned-memory-limit-of-a-partial-grant",
        "version: v1\nsharing:\n  mps:\n    grants: equal\n    resources:\n    - name: nvidia.com/gpu\n"
        "      replicas: 4\n",
        "accepted: `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=20389M,1=20389M,...,7=20389M` (81559 MiB / 4, every GPU)",
        False,
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=20389M\n",  # the same figure, for the one GPU the container sees
        difference="a partial grant's pinned-memory variable",
    ),
    Case(
        "unknown-key",
        "version: v1\nflags:\n  migStrategi: none\n" + MPS_GPU_4,
        "accepted: unknown keys are dropped",
        True,
        "flags.migStrategi: unknown key",
        difference="an unknown key",
    ),
]


def run_once(tmp_path: Path, config: str, node: str | None = None) -> subprocess.CompletedProcess[str]:
    config_file = tmp_path / "config.yaml"
    config_file.write_text(config)
    snapshot = H100_NODE
    if node is not None:
        snapshot = tmp_path / "node.yaml"
        snapshot.write_text(node)
    argv = ["--once", "--config-file", str(config_file), "--node-snapshot", str(snapshot)]
    return subprocess.run(
        [sys.executable, "-m", "mpsagent", *argv],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "LOG_FORMAT": "json"},
        check=False,
    )


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_upstream_input_gives_the_tabled_outcome(tmp_path: Path, case: Case) -> None:
    result = run_once(tmp_path, case.config, case.node)
    if case.refused:
        assert result.returncode == 2, result.stdout
        assert "Traceback" not in result.stderr
        assert case.ours in result.stderr
    else:
        assert result.returncode == 0, result.stderr
        assert case.ours in result.stdout


def log_events(stderr: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]


def test_gdrcopy_enabled_is_logged_once_as_ignored(tmp_path: Path) -> None:
    result = run_once(tmp_path, "version: v1\nflags:\n  gdrcopyEnabled: true\n" + MPS_GPU_4)
    assert result.returncode == 0, result.stderr
    ignored = [e for e in log_events(result.stderr) if e["event"] == "config key ignored"]
    assert [(e["key"], e["level"]) for e in ignored] == [("flags.gdrcopyEnabled", "info")]


def test_a_missing_version_is_read_as_v1_with_a_warning(tmp_path: Path) -> None:
    result = run_once(tmp_path, MPS_GPU_4)
    assert result.returncode == 0, result.stderr
    warnings = [e for e in log_events(result.stderr) if e["level"] == "warning"]
    assert len(warnings) == 1
    assert "version is missing; reading the file as `version: v1`" in str(warnings[0]["problem"])


@pytest.mark.parametrize(("count", "shown"), [("2.5", "2.5"), ("1.0e+300", "1e+300"), (".inf", "inf")])
def test_a_float_that_is_no_exact_count_is_refused(tmp_path: Path, count: str, shown: str) -> None:
    result = run_once(tmp_path, mps(f"    - name: nvidia.com/gpu\n      replicas: 2\n      devices: {count}\n"))
    assert result.returncode == 2
    message = f"sharing.mps.resources[0].devices: a device count must be a whole number of GPUs, not {shown}"
    assert result.stderr == f"mpsagent: error: {message}\n"


def test_a_mig_reference_names_its_position(tmp_path: Path) -> None:
    result = run_once(tmp_path, mps("    - name: nvidia.com/gpu\n      devices: [0, '1:2']\n      replicas: 4\n"))
    assert result.returncode == 2
    assert result.stderr.strip().endswith(
        "sharing.mps.resources[0].devices[1]: `1:2` is a MIG device; MIG devices cannot be shared through MPS: "
        "list whole GPUs (an index or a GPU UUID)"
    )


# --- the docs ---------------------------------------------------------------------------------------------

_DIFFERENCES_HEADING = "## Differences from the NVIDIA plugin"


def documented_differences() -> list[str]:
    """The first cells of the rows of docs/migrating.md's differences table, in order."""
    text = MIGRATING.read_text()
    assert _DIFFERENCES_HEADING in text
    section = text.split(_DIFFERENCES_HEADING, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]  # after the header and the rule
    return [re.split(r"(?<!\\)\|", row)[1].strip() for row in rows]


def test_every_difference_is_listed_once_in_the_migration_guide() -> None:
    documented = documented_differences()
    assert len(documented) == len(set(documented)), "a row is listed twice"
    tested = {case.difference for case in CASES if case.difference is not None}
    assert tested - set(documented) == set(), "a difference without a row in docs/migrating.md"
    assert set(documented) - tested == set(), "a row in docs/migrating.md without a case here"
