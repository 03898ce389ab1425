"""The monitoring examples: the alerts fire on the series the agent exports (`promtool test rules` with series
shaped as the agent's), every metric an alert names exists in a real scrape, and the scrape passes `promtool check
metrics`. The NetworkPolicy matches the Kubernetes schema."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from mpsagent_testing.agents import AgentLauncher, serve
from mpsagent_testing.kubelet.fake import FakeKubelet
from mpsagent_testing.metrics import get
from mpsagent_testing.mps.daemon import require_real_control
from mpsagent_testing.node import RESOURCE
from mpsagent_testing.repo import ROOT

require_real_control()  # the agents these tests start run the real MPS control daemon

MONITORING = ROOT / "packaging" / "kubernetes" / "monitoring"
PROMTOOL = shutil.which("promtool")
if PROMTOOL is None:
    if os.environ.get("CI"):
        raise RuntimeError(
            "promtool is missing in CI: scripts/install-system-deps.sh installs it (Debian's prometheus)"
        )
    pytest.skip("promtool not installed (run scripts/install-system-deps.sh)", allow_module_level=True)

# Each case: input series (promtool's expanding notation), when to evaluate, which alert must fire with which
# labels, and (with the same series 0-ish) that nothing fires.
UNIT_TESTS = {
    "rule_files": ["rules.yaml"],
    "evaluation_interval": "30s",
    "tests": [
        {
            "interval": "30s",
            "input_series": [
                {"series": 'mpsagent_daemon_up{node="n1",resource="nvidia.com/gpu"}', "values": "0x10"},
                {"series": 'mpsagent_daemon_up{node="n2",resource="nvidia.com/gpu"}', "values": "1x10"},
                {"series": 'mpsagent_kubelet_registered{node="n1",resource="nvidia.com/gpu"}', "values": "0x10"},
                {
                    "series": 'mpsagent_daemon_restart_attempts_total{node="n1",resource="nvidia.com/gpu"}',
                    "values": "0 1 2 3 4 5 6 7 8 9 10",
                },
                {"series": 'mpsagent_cap_tamper_total{node="n2",resource="nvidia.com/gpu"}', "values": "0 0 0 1 1 1"},
                {"series": 'up{job="mpsagent/mpsagent",node="n3"}', "values": "0x20"},
                # n4: 24 replicas Unhealthy because they are withheld beside DRA claims (a busy GPU, not a failing
                # one); n5: 4 Unhealthy, none withheld (a failing GPU).
                {
                    "series": 'mpsagent_replicas{node="n4",resource="nvidia.com/gpu",gpu="GPU-a",health="Unhealthy"}',
                    "values": "24x20",
                },
                {
                    "series": 'mpsagent_replicas_withheld{node="n4",resource="nvidia.com/gpu",gpu="GPU-a"}',
                    "values": "24x20",
                },
                {
                    "series": 'mpsagent_replicas{node="n5",resource="nvidia.com/gpu",gpu="GPU-b",health="Unhealthy"}',
                    "values": "4x20",
                },
                {
                    "series": 'mpsagent_replicas_withheld{node="n5",resource="nvidia.com/gpu",gpu="GPU-b"}',
                    "values": "0x20",
                },
                # n6: GPU-c at 45 live grants (MPS serves 48), GPU-d at 40.
                {
                    "series": 'mpsagent_gpu_live_grants{node="n6",resource="nvidia.com/gpu",gpu="GPU-c"}',
                    "values": "45x20",
                },
                {
                    "series": 'mpsagent_gpu_live_grants{node="n6",resource="nvidia.com/gpu",gpu="GPU-d"}',
                    "values": "40x20",
                },
                # n7: a claim prepare refused at the third minute.
                {"series": 'mpsagent_dra_prepares_total{node="n7",outcome="refused"}', "values": "0 0 0 0 0 0 1 1 1 1"},
                {"series": 'mpsagent_dra_prepares_total{node="n7",outcome="ok"}', "values": "0 1 2 3 4 5 6 7 8 9"},
                # n8: a pod's process on GPU-e without a share of it from the second minute; a host process on GPU-f
                # for 30 s only.
                {
                    "series": 'mpsagent_stowaway_processes{node="n8",gpu="GPU-e",pod_uid="u1",'
                    'pod_namespace="ml",pod_name="p"}',
                    "values": "_ _ _ _ 1x10",
                },
                {
                    "series": 'mpsagent_stowaway_processes{node="n8",gpu="GPU-f",pod_uid="",'
                    'pod_namespace="",pod_name=""}',
                    "values": "_ _ _ _ 1 stale",
                },
                {"series": 'mpsagent_stowaways_unchecked{node="n9"}', "values": "1x30"},
                {"series": 'mpsagent_stowaways_unchecked{node="n8"}', "values": "0x30"},
            ],
            "alert_rule_test": [
                {
                    "eval_time": "3m",
                    "alertname": "MpsagentDaemonDown",
                    "exp_alerts": [
                        {"exp_labels": {"severity": "critical", "node": "n1", "resource": "nvidia.com/gpu"}}
                    ],
                },
                {
                    "eval_time": "3m",
                    "alertname": "MpsagentNotRegistered",
                    "exp_alerts": [
                        {"exp_labels": {"severity": "critical", "node": "n1", "resource": "nvidia.com/gpu"}}
                    ],
                },
                {
                    "eval_time": "5m",
                    "alertname": "MpsagentDaemonRestarting",
                    "exp_alerts": [
                        {"exp_labels": {"severity": "critical", "node": "n1", "resource": "nvidia.com/gpu"}}
                    ],
                },
                {
                    "eval_time": "2m",
                    "alertname": "MpsagentCapsTampered",
                    "exp_alerts": [{"exp_labels": {"severity": "warning", "node": "n2", "resource": "nvidia.com/gpu"}}],
                },
                {
                    "eval_time": "6m",
                    "alertname": "MpsagentDown",
                    "exp_alerts": [{"exp_labels": {"severity": "warning", "node": "n3", "job": "mpsagent/mpsagent"}}],
                },
                {
                    "eval_time": "6m",
                    "alertname": "MpsagentReplicasUnhealthy",
                    "exp_alerts": [
                        {
                            "exp_labels": {
                                "severity": "warning",
                                "node": "n5",
                                "resource": "nvidia.com/gpu",
                                "gpu": "GPU-b",
                            }
                        }
                    ],
                },
                {
                    "eval_time": "6m",
                    "alertname": "MpsagentGpuNearClientLimit",
                    "exp_alerts": [
                        {
                            "exp_labels": {
                                "severity": "warning",
                                "node": "n6",
                                "resource": "nvidia.com/gpu",
                                "gpu": "GPU-c",
                            }
                        }
                    ],
                },
                {
                    "eval_time": "4m",
                    "alertname": "MpsagentClaimPreparesRefused",
                    "exp_alerts": [{"exp_labels": {"severity": "warning", "node": "n7", "outcome": "refused"}}],
                },
                {"eval_time": "2m", "alertname": "MpsagentClaimPreparesRefused", "exp_alerts": []},
                {
                    "eval_time": "4m",
                    "alertname": "MpsagentStowawayOnGpu",
                    "exp_alerts": [
                        {
                            "exp_labels": {
                                "severity": "warning",
                                "node": "n8",
                                "gpu": "GPU-e",
                                "pod_namespace": "ml",
                                "pod_name": "p",
                            }
                        }
                    ],
                },
                {"eval_time": "2m", "alertname": "MpsagentStowawayOnGpu", "exp_alerts": []},
                {
                    "eval_time": "12m",
                    "alertname": "MpsagentStowawaysUnchecked",
                    "exp_alerts": [{"exp_labels": {"severity": "warning", "node": "n9"}}],
                },
                # Not before its `for`: a daemon down for a minute is a restart in progress.
                {"eval_time": "1m", "alertname": "MpsagentDaemonDown", "exp_alerts": []},
            ],
        }
    ],
}


def rule_groups() -> dict:
    (rule,) = yaml.safe_load_all((MONITORING / "prometheusrule.yaml").read_text())
    return {"groups": rule["spec"]["groups"]}


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60, cwd=cwd, check=False)


def without_annotations(groups: dict) -> dict:
    """The rules without their texts: promtool compares annotations too, and these tests are about when and for
    which labels an alert fires (`promtool check rules` checks the texts' templates)."""
    for rule in groups["groups"][0]["rules"]:
        rule.pop("annotations", None)
    return groups


def test_alerts_fire_on_the_agents_series(tmp_path: Path) -> None:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rule_groups()))
    checked = promtool("check", "rules", "rules.yaml", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(without_annotations(rule_groups())))
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(UNIT_TESTS))
    tested = promtool("test", "rules", "tests.yaml", cwd=tmp_path)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_the_rule_test_catches_an_alert_that_does_not_fire(tmp_path: Path) -> None:
    groups = rule_groups()
    for rule in groups["groups"][0]["rules"]:
        if rule["alert"] == "MpsagentDaemonDown":
            rule["expr"] = "mpsagent_daemon_up == 2"
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(without_annotations(groups)))
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(UNIT_TESTS))
    assert promtool("test", "rules", "tests.yaml", cwd=tmp_path).returncode != 0


def test_every_metric_an_alert_names_is_exported_and_the_scrape_passes_promtool(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    agent, base = serve(agents, kubelet, short_dir)
    kubelet.wait_registered(RESOURCE)
    status, scrape = get(base + "/metrics")
    assert status == 200
    # Samples, and families declared without samples yet (a histogram before its first observation).
    exported = set(re.findall(r"^(\w+)", scrape, re.MULTILINE))
    for family, kind in re.findall(r"^# TYPE (\w+) (\w+)", scrape, re.MULTILINE):
        suffixes = ("_bucket", "_count", "_sum") if kind == "histogram" else ("",)
        exported |= {family + suffix for suffix in suffixes}
    named = {
        name for rule in rule_groups()["groups"][0]["rules"] for name in re.findall(r"\b(mpsagent_\w+)", rule["expr"])
    }
    assert named and named <= exported, named - exported
    checked = subprocess.run(
        [PROMTOOL or "promtool", "check", "metrics"],
        input=scrape,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert agent.stop() == 0


def test_network_policy_and_monitors_select_the_agents_pods() -> None:
    documents = {d["kind"]: d for f in MONITORING.glob("*.yaml") for d in yaml.safe_load_all(f.read_text()) if d}
    kubernetes_validate.validate(documents["NetworkPolicy"], "1.30", strict=True)
    agent_labels = {"app.kubernetes.io/name": "mpsagent"}
    assert documents["NetworkPolicy"]["spec"]["podSelector"]["matchLabels"] == agent_labels
    assert documents["NetworkPolicy"]["spec"]["ingress"][0]["ports"] == [{"protocol": "TCP", "port": 9402}]
    assert documents["PodMonitor"]["spec"]["selector"]["matchLabels"] == agent_labels
    assert documents["PodMonitor"]["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
