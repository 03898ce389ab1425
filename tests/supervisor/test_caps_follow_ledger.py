"""The daemon's caps follow the ledger's live grants, whatever a request says: an Allocate that fails leaves the
ledger and the caps as they were, and a PreStartContainer re-asserts the ledger's mode (its IDs checked as an
Allocate's are). Through the agent's socket, with the real control daemon."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from mpsagent_testing.agents import AgentLauncher, start
from mpsagent_testing.kubelet.calls import allocate
from mpsagent_testing.kubelet.fake import FakeKubelet, Plugin, wait_for
from mpsagent_testing.kubelet.stubs import dp_pb2
from mpsagent_testing.mps.daemon import REAL_BIN, control, pipe_of, require_real_control
from mpsagent_testing.node import ALL, GPU0, GPU1, RESOURCE, config, ids

require_real_control()  # the agents these tests start run the real MPS control daemon

# A front-end that passes everything to the real one, except that once `fault` holds "read-back", the next session
# that switches the defaults to the full hardware (and reads them back, in the same session) fails after the real
# front-end ran it (once): the daemon switched, and the agent cannot know that it holds what it was told. (Not
# "Cannot send command": from a daemon that greets, that is a session refused because another is open, which the
# agent asks again.)
FRONT_END = """#!/bin/sh
fault="{fault}"
[ $# -gt 0 ] && exec "{real}" "$@"
input=$(cat)
case "$(cat "$fault" 2>/dev/null):$input" in
  read-back:*"set_default_active_thread_percentage 100"*)
    rm -f "$fault"; printf '%s\\n' "$input" | "{real}" > /dev/null; echo "Invalid reply: test fault"; exit 1 ;;
esac
printf '%s\\n' "$input" | exec "{real}"
"""


def flaky_front_end(short_dir: Path) -> tuple[Path, Path]:
    fault = short_dir / "fault"
    front_end = short_dir / "front-end"
    front_end.write_text(FRONT_END.format(fault=fault, real=REAL_BIN))
    front_end.chmod(0o755)
    return front_end, fault


def ledger_status(short_dir: Path) -> dict[str, object]:
    resource = json.loads((short_dir / "mps" / "status.json").read_text())["resources"][0]
    return {
        "grants": [(g["id"], g["kind"], g["deviceIds"]) for g in resource["grants"]],
        "ledger": resource["ledger"],
    }


def pre_start(plugin: Plugin, device_ids: list[str]) -> None:
    plugin.stub.PreStartContainer(dp_pb2.PreStartContainerRequest(devices_ids=device_ids), timeout=10)


def test_an_allocate_whose_cap_switch_fails_leaves_the_ledger_and_the_caps_as_they_were(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    front_end, fault = flaky_front_end(short_dir)
    agent = start(agents, kubelet, short_dir, "--mps-control-bin", str(front_end), text=config(grants="equal"))
    plugin = kubelet.wait_registered(RESOURCE)
    pipe = pipe_of(short_dir)
    allocate(plugin, ids(GPU0, 0))
    assert control(pipe, "get_default_active_thread_percentage") == "25.0"

    fault.write_text("read-back")
    with pytest.raises(grpc.RpcError) as failed:
        allocate(plugin, ALL)  # a full grant: the daemon switches to full, then cannot be read back
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "did not hold" in failed.value.details() or "test fault" in failed.value.details()
    assert not fault.exists()
    # Answered only once the daemon holds the caps of the grants the ledger still has.
    assert control(pipe, "get_default_active_thread_percentage") == "25.0"
    assert control(pipe, "get_default_device_pinned_mem_limit 1") == "4G"

    # One more grant, so that the status shows a ledger that has seen everything before it.
    allocate(plugin, ids(GPU1, 1))

    def with_two_grants() -> dict[str, object] | None:
        status = ledger_status(short_dir)
        return status if len(status["grants"]) == 2 else None

    shown = wait_for(with_two_grants, 5, "the status with the third grant")
    assert shown["grants"] == [(1, "capped", ids(GPU0, 0)), (3, "capped", ids(GPU1, 1))]
    assert shown["ledger"] == {
        "allocated": {"full": 0, "capped": 2},
        "adopted": 0,
        "superseded": 0,
        "released": 0,
        "live": {"full": 0, "capped": 2},
    }
    granted = [e["grant"] for e in agent.log_events() if e.get("event") == "granted"]
    assert granted == [1, 3]
    assert [e["grants"] for e in agent.log_events() if e.get("event") == "allocate withdrawn"] == [[2]]


def test_pre_start_checks_its_ids_and_never_lifts_the_caps_of_live_grants(
    agents: AgentLauncher, kubelet: FakeKubelet, short_dir: Path
) -> None:
    agent = start(agents, kubelet, short_dir)
    plugin = kubelet.wait_registered(RESOURCE)
    pipe = pipe_of(short_dir)
    allocate(plugin, ids(GPU0, 0))
    assert control(pipe, "get_default_active_thread_percentage") == "25.0"

    with pytest.raises(grpc.RpcError) as refused:
        pre_start(plugin, [*ALL, "garbage"])
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == (
        f"{RESOURCE}: unknown device ID 'garbage' in the request; "
        "this resource advertises IDs of the form <GPU UUID>::<replica>"
    )
    assert control(pipe, "get_default_active_thread_percentage") == "25.0"

    # Every ID, all known: a capped grant is live, so the daemon stays capped.
    pre_start(plugin, ALL)
    assert control(pipe, "get_default_active_thread_percentage") == "25.0"
    assert control(pipe, "get_default_device_pinned_mem_limit 0") == "4G"

    # Once the ledger holds only a full grant, a pre-start of one replica leaves the daemon at full.
    allocate(plugin, ALL)
    assert control(pipe, "get_default_active_thread_percentage") == "100.0"
    pre_start(plugin, ids(GPU1, 2))
    assert control(pipe, "get_default_active_thread_percentage") == "100.0"
    assert agent.process.poll() is None
