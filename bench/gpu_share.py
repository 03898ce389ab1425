#!/usr/bin/env python3
"""What sharing one GPU through the agent buys: matmul throughput and step latency of clients alone, time-sliced,
and under the agent's grants (docs/performance.md; the H200 reference is ../shared/hardware/sharing-bench-h200.md).

Runs, each at every --sizes n (bf16 n x n matmul, one synchronize per step, --seconds per size, the clients of a
run released at once after their warm-up):

- E: one client, no MPS (the GPU to itself);
- T: four clients at once, no MPS, compute mode as found (Default): time-slicing;
- M1: one client under a 1-of-4 grant (the agent's CUDA_MPS_* environment and daemon);
- M4: four clients under four 1-of-4 grants at once;
- P2: one client under a 2-of-4 grant (`grants: proportional`: half the memory and threads);
- P3: one 2-of-4 client next to two 1-of-4 clients, at once.

The agent runs once for M1..P3 (GPU 0 as 4 replicas, `grants: proportional`, a 1-of-4 grant is what `equal` gives
too), against the test suite's fake kubelet and pod-resources server, as scripts/hardware_check.py runs it; each
run's grants are listed by pod-resources while its clients run and dropped after. On the GPU node, as root, from
the repository root (about a minute; the clients need PyTorch with CUDA in --client-python):

    /tmp/hwc-venv/bin/python bench/gpu_share.py --client-python /usr/bin/python3 --out /tmp/gpu-share

Without a GPU: `--dry-run` prints the plan; with `--node-snapshot NODE.json` it also starts the agent on the
snapshot and prints the environment each client would get (what tests/tools/test_bench.py runs).

PyTorch is required for the clients, not optional: the numbers are meant to compare with the H200 reference,
which used torch's bf16 matmul (cuBLAS); a kernel of our own through the driver API would measure something else.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import selectors
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mpsagent_testing.processes import end_group, kill_processes_using, marked_env

ROOT = Path(__file__).resolve().parents[1]

RESOURCE = "nvidia.com/gpu"
REPLICAS = 4
CONFIG = f"""version: v1
sharing:
  mps:
    failRequestsGreaterThanOne: false
    grants: proportional
    resources:
    - name: gpu
      devices: [0]
      replicas: {REPLICAS}
"""
CLIENT_PREFIX = "GPU-SHARE "
START_TIMEOUT_S = 60.0
CLIENT_READY_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Case:
    """One run: its name, and per client the replicas it is granted (0: no MPS, the GPU as found)."""

    name: str
    what: str
    grants: tuple[int, ...]

    @property
    def mps(self) -> bool:
        return any(self.grants)

    def shares(self) -> list[str]:
        return [f"{k}/{REPLICAS}" if k else "none" for k in self.grants]


CASES = (
    Case("E", "one client, no MPS", (0,)),
    Case("T", "four clients, no MPS: time-slicing", (0, 0, 0, 0)),
    Case("M1", "one client, 1 of 4 replicas", (1,)),
    Case("M4", "four clients, 1 of 4 replicas each", (1, 1, 1, 1)),
    Case("P2", "one client, 2 of 4 replicas (proportional)", (2,)),
    Case("P3", "one 2-of-4 client next to two 1-of-4 clients", (2, 1, 1)),
)


# --- the client (`--client`): PyTorch, in a child process --------------------------------------------------------


def _emit(kind: str, **values: Any) -> None:
    print(CLIENT_PREFIX + json.dumps({"kind": kind, **values}), flush=True)


def client_main(sizes: list[int], seconds: float) -> int:
    """For each size: warm up, say `ready`, wait for a line on stdin (all clients go at once), run `seconds` of
    matmul steps and print their rate and step times. Any failure is one `error` message."""
    try:
        import torch  # noqa: PLC0415 - only the client needs it
    except ImportError as exc:
        _emit("error", error=f"no PyTorch: {exc}")
        return 1
    if not torch.cuda.is_available():
        _emit("error", error="torch.cuda.is_available() is False")
        return 1
    try:
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        for n in sizes:
            if not _measure(torch, n, seconds, sms):
                return 1  # the parent went away
    except Exception as exc:
        _emit("error", error=f"{type(exc).__name__}: {exc}")
        return 1
    return 0


def _measure(torch: Any, n: int, seconds: float, sms: int) -> bool:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        torch.matmul(a, b)
    torch.cuda.synchronize()
    _emit("ready", n=n)
    if not sys.stdin.readline():
        return False
    steps: list[float] = []
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        before = time.perf_counter()
        torch.matmul(a, b)
        torch.cuda.synchronize()
        steps.append(time.perf_counter() - before)
    elapsed = time.perf_counter() - started
    _emit("result", n=n, steps=len(steps), seconds=elapsed, stepTimes=_summary(steps), sms=sms)
    return True


def _summary(steps: list[float]) -> dict[str, float]:
    ordered = sorted(steps)
    return {
        "p50Ms": round(statistics.median(ordered) * 1000, 3),
        "p99Ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000, 3),
    }


# --- the run -------------------------------------------------------------------------------------------------


@dataclass
class Row:
    case: Case
    n: int
    per_client: list[dict[str, Any]] = field(default_factory=list)

    def tflops(self, result: dict[str, Any]) -> float:
        return 2 * self.n**3 * int(result["steps"]) / float(result["seconds"]) / 1e12

    def cells(self) -> list[str]:
        rates = [round(self.tflops(r), 1) for r in self.per_client]
        return [
            self.case.name,
            str(self.n),
            str(len(self.case.grants)),
            ", ".join(self.case.shares()),
            f"{sum(rates):.1f}",
            str(rates),
            str([r["stepTimes"]["p50Ms"] for r in self.per_client]),
            str([r["stepTimes"]["p99Ms"] for r in self.per_client]),
            str([r["sms"] for r in self.per_client]),
        ]


HEADER = ["run", "n", "clients", "grants", "aggregate TFLOP/s", "per client TFLOP/s", "p50 ms", "p99 ms", "SMs seen"]


def table(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row.cells()) + " |" for row in rows]
    return "\n".join(lines) + "\n"


class ShareBench:
    """The fake kubelet and pod-resources server, the agent (started once for the MPS runs), the clients; `close`
    ends all of them and whatever still carries the work directory's marker (the MPS daemon and its servers)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = Path(tempfile.mkdtemp(prefix="gpushare-", dir="/tmp"))
        self.mps_root = self.work / "mps"
        self.pipe = self.mps_root / RESOURCE / "pipe"
        self.kubelet: Any = None
        self.pod_resources: Any = None
        self.agent: subprocess.Popen[bytes] | None = None
        self.plugin: Any = None
        self.ids: list[str] = []
        self.clients: list[subprocess.Popen[bytes]] = []

    def close(self) -> None:
        for client in self.clients:
            end_group(client, timeout_s=5)
        if self.agent is not None:
            end_group(self.agent, timeout_s=20)  # --mps-on-exit quit: it quits the daemon and restores the compute mode
        for fake in (self.kubelet, self.pod_resources):
            if fake is not None:
                with contextlib.suppress(Exception):
                    fake.stop()
        for _ in range(3):
            if not kill_processes_using(self.work):
                break
            time.sleep(0.1)
        if not self.args.keep_work:
            shutil.rmtree(self.work, ignore_errors=True)

    def start_agent(self) -> None:
        from mpsagent_testing.kubelet.fake import FakeKubelet  # noqa: PLC0415 - needs grpcio (the test extra)
        from mpsagent_testing.kubelet.podresources import FakePodResources  # noqa: PLC0415

        (self.work / "dp").mkdir()
        (self.work / "config.yaml").write_text(CONFIG)
        self.pod_resources = FakePodResources(self.work / "pr" / "kubelet.sock").start()
        self.kubelet = FakeKubelet(self.work / "dp" / "kubelet.sock").start()
        argv = [sys.executable, "-m", "mpsagent", "--config-file", str(self.work / "config.yaml")]
        argv += ["--mps-root", str(self.mps_root), "--nfd-features-file", ""]
        if self.args.node_snapshot is not None:
            argv += ["--node-snapshot", str(self.args.node_snapshot)]
        argv += ["--kubelet-socket", str(self.kubelet.socket_path)]
        argv += ["--pod-resources-socket", str(self.pod_resources.socket_path)]
        argv += ["--mps-on-exit", "quit", "--log-format", "json"]
        python_path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        with (self.work / "agent.log").open("wb") as log:
            self.agent = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env=marked_env(self.work, {"PYTHONPATH": python_path}),
                start_new_session=True,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.agent.poll() is not None:
                raise RuntimeError(f"the agent exited {self.agent.returncode}: {self.agent_log_tail()}")
            plugins = [p for p in list(self.kubelet.plugins) if p.request.resource_name == RESOURCE and p.updates]
            if plugins:
                self.plugin = plugins[-1]
                self.ids = sorted(device[0] for device in self.plugin.latest())
                return
            time.sleep(0.05)
        raise RuntimeError(f"the agent did not register within {START_TIMEOUT_S:.0f} s: {self.agent_log_tail()}")

    def agent_log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return "\n".join((self.work / "agent.log").read_text(errors="replace").splitlines()[-20:])
        return "<no agent log>"

    def grant(self, case: Case) -> list[dict[str, str]]:
        """Allocate each client's replicas (distinct IDs of GPU 0) and list them all, as the kubelet does once the
        pods run; returns each client's container environment."""
        from mpsagent_testing.kubelet.podresources import ListedContainer  # noqa: PLC0415
        from mpsagent_testing.kubelet.stubs import dp_pb2  # noqa: PLC0415

        envs, listed, taken = [], [], 0
        for index, k in enumerate(case.grants):
            ids = self.ids[taken : taken + k]
            taken += k
            request = dp_pb2.AllocateRequest(container_requests=[dp_pb2.ContainerAllocateRequest(devices_ids=ids)])
            response = self.plugin.stub.Allocate(request, timeout=30).container_responses[0]
            envs.append(dict(response.envs))
            listed.append(ListedContainer("bench", f"{case.name.lower()}-{index}", "main", RESOURCE, tuple(ids)))
        self.pod_resources.set_containers(*listed)
        return envs

    def ceilings(self) -> str:
        """The control daemon's defaults, the ceilings the agent holds for the live grants."""
        env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe)}
        answers = []
        for command in ("get_default_active_thread_percentage", "get_default_device_pinned_mem_limit 0"):
            done = subprocess.run(
                ["nvidia-cuda-mps-control"],
                input=command + "\n",
                capture_output=True,
                text=True,
                timeout=10,
                env=env,
                check=False,
            )
            answers.append(done.stdout.strip() or done.stderr.strip())
        return f"threads {answers[0]}, memory {answers[1]}"

    def client_env(self, container_env: dict[str, str] | None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS_")}
        env["CUDA_VISIBLE_DEVICES"] = "0"
        if container_env is not None:
            env.update(container_env)
            env["CUDA_MPS_PIPE_DIRECTORY"] = str(self.pipe)  # the host's side of the container's /mps mount
        return marked_env(self.work, env)

    def run_case(self, case: Case, envs: list[dict[str, str]] | None) -> list[Row]:
        """Start the case's clients, release them together at each size, collect their results."""
        argv = [self.args.client_python, str(Path(__file__).resolve()), "--client"]
        argv += ["--sizes", ",".join(map(str, self.args.sizes)), "--seconds", str(self.args.seconds)]
        clients = []
        for index in range(len(case.grants)):
            with (self.work / f"client-{case.name}-{index}.stderr").open("wb") as stderr:
                process = subprocess.Popen(
                    argv,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=stderr,
                    env=self.client_env(envs[index] if envs else None),
                    cwd=self.work,
                    start_new_session=True,
                )
            self.clients.append(process)
            clients.append(Client(process))
        rows = []
        try:
            for n in self.args.sizes:
                for client in clients:
                    client.expect("ready", CLIENT_READY_TIMEOUT_S)
                for client in clients:
                    client.send_go()
                row = Row(case, n)
                row.per_client = [client.expect("result", self.args.seconds + 60) for client in clients]
                rows.append(row)
                say(f"{case.name} n={n}: aggregate {row.cells()[4]} TFLOP/s, per client {row.cells()[5]}")
        finally:
            for client in clients:
                end_group(client.process, timeout_s=5)
        return rows


class Client:
    """One client process and what it has said so far; every read is bounded."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self.process = process
        self.buffer = b""

    def send_go(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(b"go\n")
        self.process.stdin.flush()

    def expect(self, kind: str, timeout_s: float) -> dict[str, Any]:
        """Its next message, which must be `kind`: an `error` message, an exit or no message in time stops the run."""
        message = self.next_message(timeout_s)
        if message is None:
            code = self.process.poll()
            state = f"exited {code}" if code is not None else f"said nothing within {timeout_s:.0f} s"
            raise RuntimeError(f"client {self.process.pid} {state} before `{kind}`")
        if message["kind"] != kind:
            raise RuntimeError(f"client {self.process.pid}: {message.get('error', message)}")
        return message

    def next_message(self, timeout_s: float) -> dict[str, Any] | None:
        assert self.process.stdout is not None
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            while True:
                line, newline, rest = self.buffer.partition(b"\n")
                if newline:
                    self.buffer = rest
                    text = line.decode(errors="replace")
                    if text.startswith(CLIENT_PREFIX):
                        parsed: dict[str, Any] = json.loads(text[len(CLIENT_PREFIX) :])
                        return parsed
                    continue
                left = deadline - time.monotonic()
                if left <= 0 or not selector.select(timeout=min(1.0, left)):
                    if left <= 0:
                        return None
                    continue
                chunk = os.read(self.process.stdout.fileno(), 65536)
                if not chunk:
                    return None
                self.buffer += chunk


_T0 = time.monotonic()


def say(message: str) -> None:
    print(f"[gpu-share {time.monotonic() - _T0:5.1f}s] {message}", file=sys.stderr, flush=True)


def plan_text(args: argparse.Namespace) -> str:
    total = len(CASES) * len(args.sizes) * args.seconds
    lines = [
        f"sizes {args.sizes}, {args.seconds:g} s per size and run ({total:g} s of measuring), "
        f"clients: PyTorch in {args.client_python}",
        "",
        "| run | what | grants | MPS |",
        "|---|---|---|---|",
    ]
    lines += [f"| {c.name} | {c.what} | {', '.join(c.shares())} | {'yes' if c.mps else 'no'} |" for c in CASES]
    lines += ["", "Agent configuration for the MPS runs:", "", "```yaml", CONFIG.rstrip(), "```"]
    return "\n".join(lines) + "\n"


def dry_run(args: argparse.Namespace) -> int:
    print(plan_text(args))
    if args.node_snapshot is None:
        return 0
    bench = ShareBench(args)
    try:
        bench.start_agent()
        for case in CASES:
            if case.mps:
                envs = bench.grant(case)
                print(f"{case.name}: " + json.dumps([_caps(env) for env in envs]) + f"; daemon {bench.ceilings()}")
                bench.pod_resources.set_containers()
    finally:
        bench.close()
    return 0


def _caps(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in sorted(env.items()) if k.startswith("CUDA_MPS_") and k != "CUDA_MPS_PIPE_DIRECTORY"}


def bench_main(args: argparse.Namespace) -> int:
    check = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)"
    found = subprocess.run([args.client_python, "-c", check], capture_output=True, timeout=120, check=False)
    if found.returncode != 0:
        print(
            f"gpu_share: error: {args.client_python} has no PyTorch with CUDA (the clients need it): "
            "pass --client-python with one, or install torch there",
            file=sys.stderr,
        )
        return 2
    print(plan_text(args))
    bench = ShareBench(args)
    rows: list[Row] = []
    try:
        for case in CASES:
            if case.mps and bench.agent is None:
                bench.start_agent()  # after the runs without MPS: the agent sets Exclusive_Process
            envs = bench.grant(case) if case.mps else None
            if case.mps:
                say(f"{case.name}: daemon {bench.ceilings()}")
            rows += bench.run_case(case, envs)
            if case.mps:
                bench.pod_resources.set_containers()
    finally:
        bench.close()
    text = table(rows)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu-share.md").write_text(text)
        document = [{"run": r.case.name, "n": r.n, "grants": r.case.shares(), "clients": r.per_client} for r in rows]
        (args.out / "gpu-share.json").write_text(json.dumps(document, indent=2) + "\n")
    return 0


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None
    if not sizes or any(not 64 <= n <= 32768 for n in sizes):
        raise argparse.ArgumentTypeError(f"each size must be 64..32768: {text!r}")
    return sizes


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/gpu_share.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="print the plan; start no GPU client")
    parser.add_argument("--node-snapshot", type=Path, help="with --dry-run: run the agent on this snapshot")
    parser.add_argument("--sizes", type=_sizes, default=[1024, 8192], help="matmul sizes n (default 1024,8192)")
    parser.add_argument("--seconds", type=float, default=3.0, help="measuring time per size and run (default 3)")
    parser.add_argument("--client-python", default=sys.executable, help="interpreter with PyTorch for the clients")
    parser.add_argument("--out", type=Path, help="also write gpu-share.md and gpu-share.json here")
    parser.add_argument("--keep-work", action="store_true", help="keep the /tmp/gpushare-* work directory")
    parser.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not 0.5 <= args.seconds <= 60:
        parser.error(f"--seconds must be 0.5..60, not {args.seconds:g}")
    if args.node_snapshot is not None and not args.dry_run:
        parser.error("--node-snapshot goes with --dry-run (on a GPU node the agent reads NVML)")
    if args.node_snapshot is not None and not args.node_snapshot.is_file():
        parser.error(f"--node-snapshot: no file at {args.node_snapshot}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.client:
        return client_main(args.sizes, args.seconds)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind through `close`
    return dry_run(args) if args.dry_run else bench_main(args)


if __name__ == "__main__":
    sys.exit(main())
