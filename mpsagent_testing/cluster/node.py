"""The running node: `up` starts etcd, the API server, the controller-manager, the scheduler, containerd and the
kubelet on loopback (every wait bounded) and records each PID; `restart_kubelet` stops the kubelet and starts it
again as a real restart does; `down` ends every recorded process (and every container containerd started), unmounts
what lies under the node's directories and removes the kubelet's, containerd's and the node's state."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from mpsagent_testing.cluster import images
from mpsagent_testing.cluster.build import binary, ensure_binaries
from mpsagent_testing.cluster.layout import (
    API_PORT,
    CDI_SPEC_DIRS,
    CONTAINERD_SOCKET,
    ETCD_PORT,
    KUBECONFIG,
    KUBELET_ROOT,
    KUBERNETES_VERSION,
    LOGS,
    PAUSE_IMAGE,
    PIDS,
    RUN,
    SERVICE_CIDR,
    STATE,
    TOOLS_BIN,
    VERSION_VARIABLE,
)
from mpsagent_testing.processes import kill_container

MADE_ELSEWHERE = (
    Path("/var/lib/cni"),
    Path("/var/log/pods"),
    Path("/var/log/containers"),
    Path("/run/containerd"),
    *CDI_SPEC_DIRS,
)
"""Directories outside the node's own that its parts make at fixed paths (the CNI library's results, the kubelet's
container logs, the shims' sockets and runc's state, containerd's CDI spec directories); `down` removes each that
`up` found missing."""
HOSTS = Path("/etc/hosts")
STOP_GRACE_S = 10.0
START_TIMEOUT_S = 90.0
FEATURE_GATES = {"ResourceHealthStatus": True}
"""Device health in pod status (`allocatedResourcesStatus`, KEP-4680), for the agent's health scenarios."""
AUDITED_NAMESPACE = "mpsagent-audited"
"""The API server logs every request of this namespace's service accounts, and no one else's, to AUDIT_LOG (its
metadata: who, verb, resource, stage, status), so that a client's own requests can be counted: the rack's agents
(`mpsagent_testing.rack`) each run as one. Its request metrics have no user label."""
AUDIT_LOG = LOGS / "audit.log"


class NodeError(RuntimeError):
    """The node could not be brought up or down; the message says which part and has its log's tail."""


class OtherReleaseUp(NodeError):
    """`up` was asked for one Kubernetes release while a node of another is up; that node is left as it is."""


def node_name() -> str:
    return socket.gethostname().lower()


def log_tail(name: str, lines: int = 40) -> str:
    path = LOGS / f"{name}.log"
    if not path.is_file():
        return f"(no {path})"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


# --- processes --------------------------------------------------------------------------------------------------


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks (field 22 of /proc/PID/stat), which tells a reused PID apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


@dataclass(frozen=True)
class Recorded:
    name: str
    pid: int
    start: int
    argv: list[str]

    def alive(self) -> bool:
        if _start_time(self.pid) != self.start:
            return False
        with contextlib.suppress(OSError):
            return "State:\tZ" not in Path(f"/proc/{self.pid}/status").read_text()
        return False


def recorded() -> dict[str, Recorded]:
    if not PIDS.is_file():
        return {}
    return {name: Recorded(name=name, **entry) for name, entry in json.loads(PIDS.read_text()).items()}


def running_version() -> str | None:
    """The Kubernetes release of the recorded kubelet (the cache folder its binary is in); None without one."""
    kubelet = recorded().get("kubelet")
    return Path(kubelet.argv[0]).parent.parent.name if kubelet else None


def _record(process: Recorded) -> None:
    entries = {name: {"pid": p.pid, "start": p.start, "argv": p.argv} for name, p in recorded().items()}
    entries[process.name] = {"pid": process.pid, "start": process.start, "argv": process.argv}
    tmp = PIDS.with_suffix(".tmp")
    tmp.write_text(json.dumps(entries, indent=1))
    tmp.replace(PIDS)


def _spawn(name: str, argv: list[str], **env: str) -> Recorded:
    LOGS.mkdir(parents=True, exist_ok=True)
    with (LOGS / f"{name}.log").open("ab") as log:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **env},
        )
    start = _start_time(process.pid)
    entry = Recorded(name=name, pid=process.pid, start=start or 0, argv=argv)
    _record(entry)
    return entry


def _stop(process: Recorded, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM, then SIGKILL after `grace_s`; returns once the process is gone."""
    if not process.alive():
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while process.alive() and time.monotonic() < deadline:
        _reap(process.pid)
        time.sleep(0.05)
    if process.alive():
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while process.alive() and time.monotonic() < deadline:
            _reap(process.pid)
            time.sleep(0.05)
    _reap(process.pid)


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def _shims() -> list[int]:
    """The containerd shims of this node's containerd (they name its socket), which outlive containerd."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if argv[0].endswith(b"containerd-shim-runc-v2") and str(CONTAINERD_SOCKET).encode() in argv:
                found.append(int(entry.name))
    return found


def _kill_containers() -> int:
    """SIGKILL every shim of this node and everything below it (the containers' processes); how many."""
    return sum(len(kill_container(shim)) for shim in _shims())


# --- waits ------------------------------------------------------------------------------------------------------


def _wait(check: Callable[[], bool], what: str, watched: Recorded, timeout: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if not watched.alive():
            raise NodeError(f"{watched.name} exited while waiting for {what}:\n{log_tail(watched.name)}")
        if time.monotonic() > deadline:
            raise NodeError(f"waited {timeout:g} s for {what}:\n{log_tail(watched.name)}")
        time.sleep(0.1)


def _http_ok(url: str, context: ssl.SSLContext | None = None, token: str | None = None) -> bool:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=2, context=context) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def _admin_token() -> str:
    return (STATE / "admin.token").read_text().strip()


def _api_context() -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(STATE / "pki" / "ca.crt"))


def api_ready() -> bool:
    return _http_ok(f"https://127.0.0.1:{API_PORT}/readyz", _api_context(), _admin_token())


def api_request(method: str, path: str, body: object = None, timeout: float = 5) -> http.client.HTTPResponse:
    """An open response of the API server to `method path` (as the node's administrator); the caller reads and
    closes it. Raises OSError (urllib's HTTPError included) when the request fails."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {_admin_token()}", "Content-Type": "application/json"}
    request = urllib.request.Request(f"https://127.0.0.1:{API_PORT}{path}", data=data, headers=headers, method=method)
    response: http.client.HTTPResponse = urllib.request.urlopen(request, timeout=timeout, context=_api_context())
    return response


def _api_get(path: str) -> dict[str, object] | None:
    try:
        with api_request("GET", path) as response:
            document: dict[str, object] = json.load(response)
            return document
    except OSError:
        return None


def node_ready() -> bool:
    """The node's Ready condition is True and it carries no not-ready taint (the node lifecycle controller's)."""
    node = _api_get(f"/api/v1/nodes/{node_name()}")
    if not isinstance(node, dict):
        return False
    status, spec = node.get("status", {}), node.get("spec", {})
    assert isinstance(status, dict) and isinstance(spec, dict)
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions", []))
    tainted = any(t.get("key", "").startswith("node.kubernetes.io/not-ready") for t in spec.get("taints") or [])
    return ready and not tainted


def kubelet_healthy() -> bool:
    return _http_ok("http://127.0.0.1:10248/healthz")


def _kubelet_get(path: str) -> str:
    """GET `path` of the kubelet's authenticated port (anonymous and always allowed on this node, on loopback)."""
    unverified = ssl.create_default_context()
    unverified.check_hostname = False
    unverified.verify_mode = ssl.CERT_NONE  # the kubelet's self-signed serving certificate
    with urllib.request.urlopen(f"https://127.0.0.1:10250{path}", timeout=10, context=unverified) as response:
        return str(response.read().decode(errors="replace"))


def kubelet_goroutines() -> str:
    """The kubelet's goroutines with their stacks (its pprof handler), or why not."""
    try:
        return _kubelet_get("/debug/pprof/goroutine?debug=2")
    except OSError as exc:
        return f"(the kubelet's goroutines could not be read: {exc})"


def kubelet_pods() -> set[str]:
    """The names of the pods the kubelet has (its pod manager's, `namespace/name`): a restarted kubelet has none
    until it has listed them from the API server. A pod deleted before that is an orphan to it, killed without its
    DRA claims unprepared (its DRA manager's reconcile loop does that, up to a minute later)."""
    listed = json.loads(_kubelet_get("/pods"))
    return {f"{p['metadata']['namespace']}/{p['metadata']['name']}" for p in listed.get("items") or []}


# --- configuration ----------------------------------------------------------------------------------------------


def _openssl(*args: str) -> None:
    done = subprocess.run(["openssl", *args], capture_output=True, text=True, timeout=60, check=False)
    if done.returncode != 0:
        raise NodeError(f"openssl {args[0]} failed: {done.stderr.strip()[-1000:]}")


def _pki() -> None:
    """A CA, the API server's serving certificate (loopback, the node's name, the service IP) and the service
    account signing key, made anew for each node."""
    pki = STATE / "pki"
    pki.mkdir(parents=True)
    ca, key = str(pki / "ca.crt"), str(pki / "ca.key")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", ca, "-days", "7",
             "-subj", "/CN=mpsagent-e2e-ca")  # fmt: skip
    service_ip = SERVICE_CIDR.rsplit(".", 1)[0] + ".1"
    names = f"IP:127.0.0.1,DNS:localhost,DNS:{node_name()},IP:{service_ip},DNS:kubernetes,DNS:kubernetes.default.svc"
    (pki / "san.cnf").write_text(f"subjectAltName={names}\n")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(pki / "apiserver.key"),
             "-out", str(pki / "apiserver.csr"), "-subj", "/CN=kube-apiserver")  # fmt: skip
    _openssl("x509", "-req", "-in", str(pki / "apiserver.csr"), "-CA", ca, "-CAkey", key, "-CAcreateserial",
             "-out", str(pki / "apiserver.crt"), "-days", "7", "-extfile", str(pki / "san.cnf"))  # fmt: skip
    _openssl("genrsa", "-out", str(pki / "sa.key"), "2048")
    _openssl("rsa", "-in", str(pki / "sa.key"), "-pubout", "-out", str(pki / "sa.pub"))


def write_kubeconfig(path: Path, user: str, token: str) -> None:
    """A kubeconfig (JSON is YAML) for `user` with a bearer token."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "e2e",
                "cluster": {
                    "server": f"https://127.0.0.1:{API_PORT}",
                    "certificate-authority": str(STATE / "pki" / "ca.crt"),
                },
            }
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": user}}],
        "current-context": "e2e",
    }
    path.write_text(json.dumps(config, indent=1))
    path.chmod(0o600)


def _credentials() -> None:
    admin, kubelet = secrets.token_hex(16), secrets.token_hex(16)
    node = f"system:node:{node_name()}"
    (STATE / "tokens.csv").write_text(f'{admin},admin,admin,"system:masters"\n{kubelet},{node},{node},"system:nodes"\n')
    (STATE / "admin.token").write_text(admin)
    write_kubeconfig(KUBECONFIG, "admin", admin)
    write_kubeconfig(STATE / "kubelet.kubeconfig", node, kubelet)


def _audit_policy() -> Path:
    """Metadata of the requests of AUDITED_NAMESPACE's service accounts; nothing of anyone else's (the node's own
    parts and the tests write no audit line)."""
    path = STATE / "audit-policy.json"
    rules = [{"level": "Metadata", "userGroups": [f"system:serviceaccounts:{AUDITED_NAMESPACE}"]}, {"level": "None"}]
    policy = {"apiVersion": "audit.k8s.io/v1", "kind": "Policy", "omitStages": ["RequestReceived"], "rules": rules}
    path.write_text(json.dumps(policy, indent=1))
    return path


def _containerd_config() -> Path:
    cni = STATE / "cni"
    cni.mkdir()
    # Loopback only: the node serves hostNetwork pods, and no bridge or private address range is set up.
    (cni / "10-loopback.conflist").write_text(
        json.dumps({"cniVersion": "1.0.0", "name": "mpsagent-e2e", "plugins": [{"type": "loopback"}]})
    )
    path = STATE / "containerd.toml"
    path.write_text(
        f"""version = 4
root = "{STATE / "containerd"}"
state = "{RUN / "containerd"}"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.erofs", "io.containerd.internal.v1.opt",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.nri.v1.nri"]
[plugins.'io.containerd.server.v1.grpc']
  address = "{CONTAINERD_SOCKET}"
[plugins.'io.containerd.server.v1.ttrpc']
  address = "{CONTAINERD_SOCKET}.ttrpc"
[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{PAUSE_IMAGE}"
[plugins.'io.containerd.cri.v1.runtime']
  # No CAP_SYS_RESOURCE on these machines: runc cannot lower the sandbox's oom_score_adj below the node's own.
  restrict_oom_score_adj = true
  cdi_spec_dirs = [{", ".join(f'"{d}"' for d in CDI_SPEC_DIRS)}]
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["/usr/lib/cni"]
    conf_dir = "{cni}"
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = "127.0.0.1"
"""
    )
    return path


def _kubelet_config() -> Path:
    path = STATE / "kubelet.yaml"
    config = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": "127.0.0.1",
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": 10248,
        "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
        "authorization": {"mode": "AlwaysAllow"},
        "containerRuntimeEndpoint": f"unix://{CONTAINERD_SOCKET}",
        # cgroup v1 on these machines, without a systemd to delegate to.
        "failCgroupV1": False,
        "cgroupDriver": "cgroupfs",
        "cgroupsPerQOS": False,
        "enforceNodeAllocatable": [],
        "failSwapOn": False,
        # Every 2 s instead of 10 s: node allocatable follows the device plugin sooner, which keeps the scenarios
        # short; nothing the agent does depends on it.
        "nodeStatusUpdateFrequency": "2s",
        "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False,
        "featureGates": FEATURE_GATES,
    }
    path.write_text(json.dumps(config, indent=1))
    return path


def _ensure_hostname_is_loopback() -> None:
    """The API server reaches the kubelet by the node's name (`--kubelet-preferred-address-types=Hostname`): map it
    to 127.0.0.1 when it resolves elsewhere, and remember to take the line out again."""
    name = node_name()
    with contextlib.suppress(OSError):
        if all(info[4][0].startswith("127.") for info in socket.getaddrinfo(name, None, socket.AF_INET)):
            return
    line = f"127.0.0.1 {name} # mpsagent-e2e\n"
    text = HOSTS.read_text()
    HOSTS.write_text(text + ("" if text.endswith("\n") else "\n") + line)
    (STATE / "hosts-line").write_text(line)


# --- up, restart, down ------------------------------------------------------------------------------------------


def _apiserver_argv() -> list[str]:
    pki = STATE / "pki"
    return [
        str(binary("kube-apiserver")),
        f"--etcd-servers=http://127.0.0.1:{ETCD_PORT}",
        "--bind-address=127.0.0.1",
        "--advertise-address=127.0.0.1",
        f"--secure-port={API_PORT}",
        f"--cert-dir={pki}",
        f"--tls-cert-file={pki / 'apiserver.crt'}",
        f"--tls-private-key-file={pki / 'apiserver.key'}",
        f"--token-auth-file={STATE / 'tokens.csv'}",
        "--authorization-mode=AlwaysAllow",
        "--service-account-issuer=https://kubernetes.default.svc",
        f"--service-account-key-file={pki / 'sa.pub'}",
        f"--service-account-signing-key-file={pki / 'sa.key'}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--endpoint-reconciler-type=none",
        # The daemon host's init container mounts the MPS shm tmpfs: a privileged container.
        "--allow-privileged=true",
        "--kubelet-preferred-address-types=Hostname",
        "--feature-gates=" + ",".join(f"{gate}={str(on).lower()}" for gate, on in FEATURE_GATES.items()),
        "--profiling=false",
        f"--audit-policy-file={_audit_policy()}",
        f"--audit-log-path={AUDIT_LOG}",
    ]


def _etcd_argv() -> list[str]:
    peer = "http://127.0.0.1:2380"
    return [
        shutil.which("etcd") or "etcd",
        "--name=e2e",
        f"--data-dir={STATE / 'etcd'}",
        f"--listen-client-urls=http://127.0.0.1:{ETCD_PORT}",
        f"--advertise-client-urls=http://127.0.0.1:{ETCD_PORT}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=e2e={peer}",
    ]


def _controller_manager_argv() -> list[str]:
    return [
        str(binary("kube-controller-manager")),
        f"--kubeconfig={KUBECONFIG}",
        "--leader-elect=false",
        "--bind-address=127.0.0.1",
        f"--service-account-private-key-file={STATE / 'pki' / 'sa.key'}",
        f"--root-ca-file={STATE / 'pki' / 'ca.crt'}",
        "--controllers=*",
    ]


def _scheduler_argv() -> list[str]:
    return [str(binary("kube-scheduler")), f"--kubeconfig={KUBECONFIG}", "--leader-elect=false",
            "--bind-address=127.0.0.1"]  # fmt: skip


def _kubelet_argv() -> list[str]:
    return [
        str(binary("kubelet")),
        f"--config={STATE / 'kubelet.yaml'}",
        f"--kubeconfig={STATE / 'kubelet.kubeconfig'}",
        f"--root-dir={KUBELET_ROOT}",
        "--v=2",
    ]


def _containerd_ready() -> bool:
    return CONTAINERD_SOCKET.exists() and images.ctr("version", timeout=10).returncode == 0


def up(log: Callable[[str], None] = lambda line: print(line, file=sys.stderr)) -> dict[str, float]:
    """Start the node and wait until it is Ready; the seconds each step took. A node of this Kubernetes release
    that is already up is left as it is (one of another release is refused); what a node that is partly up (or was
    left by a machine's restart) left behind is taken down first."""
    running = recorded()
    if running:
        if all(p.alive() for p in running.values()) and len(running) == 6 and node_ready():
            if running_version() != KUBERNETES_VERSION:
                raise OtherReleaseUp(
                    f"a Kubernetes {running_version()} node is up and this run asks for {KUBERNETES_VERSION} "
                    f"({VERSION_VARIABLE}): `scripts/e2e-cluster down` first"
                )
            return {}
        for line in down():
            log(f"e2e-cluster: (a node was partly up) {line}")
    if KUBELET_ROOT.exists() and any(KUBELET_ROOT.iterdir()):
        raise NodeError(f"{KUBELET_ROOT} exists: another kubelet's state? Remove it or run `scripts/e2e-cluster down`")
    took: dict[str, float] = {}
    started = time.monotonic()

    def step(name: str) -> None:
        nonlocal started
        now = time.monotonic()
        took[name] = round(now - started, 2)
        log(f"e2e-cluster: {name} ({took[name]:.1f} s)")
        started = now

    for directory in (STATE, RUN):
        directory.mkdir(parents=True, exist_ok=True)
        directory.chmod(0o700)
    made = [str(path) for path in MADE_ELSEWHERE if not path.exists()]
    (STATE / "made-elsewhere.json").write_text(json.dumps(made))
    _ensure_hostname_is_loopback()
    _pki()
    _credentials()
    archives = images.base_archives()
    step("configured")
    etcd = _spawn("etcd", _etcd_argv())
    _wait(lambda: _http_ok(f"http://127.0.0.1:{ETCD_PORT}/health"), "etcd to answer", etcd)
    step("etcd")
    apiserver = _spawn("kube-apiserver", _apiserver_argv())
    _wait(api_ready, "the API server to be ready", apiserver)
    step("kube-apiserver")
    _spawn("kube-controller-manager", _controller_manager_argv())
    _spawn("kube-scheduler", _scheduler_argv())
    containerd_argv = [str(binary("containerd")), "--config", str(_containerd_config())]
    # Its shim is found on PATH: the one built with it.
    containerd = _spawn("containerd", containerd_argv, PATH=f"{TOOLS_BIN}:{os.environ.get('PATH', '')}")
    _wait(_containerd_ready, "containerd to answer", containerd)
    for archive in archives:
        images.import_archive(archive)
    step("containerd")
    _kubelet_config()
    kubelet = _spawn("kubelet", _kubelet_argv())
    _wait(node_ready, f"node {node_name()} to be Ready", kubelet)
    step("node Ready")
    _wait(lambda: _api_get("/api/v1/namespaces/default/serviceaccounts/default") is not None,
          "the default service account", recorded()["kube-controller-manager"])  # fmt: skip
    step("controllers")
    return took


@contextmanager
def up_meanwhile() -> Iterator[None]:
    """The node up (built first if the cache lacks a part) for what runs inside; taken down after it unless it was
    up before: the benches' way to use the node without disturbing one an operator keeps up."""
    ensure_binaries()
    was_up = bool(recorded()) and node_ready()
    up()
    try:
        yield
    finally:
        if not was_up:
            down()


def restart_kubelet(stopped_s: float = 0.0) -> None:
    """Stop the kubelet (SIGTERM, as systemd does) and start it again with the same command line after
    `stopped_s`; returns when it answers its health check again."""
    kubelet = recorded().get("kubelet")
    if kubelet is None:
        raise NodeError("no kubelet is recorded: run `scripts/e2e-cluster up` first")
    _stop(kubelet)
    time.sleep(stopped_s)
    again = _spawn("kubelet", kubelet.argv)
    _wait(kubelet_healthy, "the restarted kubelet's health check", again)


def _mounts_below(roots: list[Path]) -> list[str]:
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if any(point == str(root) or point.startswith(f"{root}/") for root in roots):
            found.append(point)
    return sorted(set(found), key=lambda p: p.count("/"), reverse=True)


UNMOUNT_PASSES = 4
"""A point can be mounted more than once (a bind over itself, a tmpfs on it): passes until nothing is left."""


def unmount_below(*roots: Path) -> list[str]:
    """Unmount everything at or below `roots`, deepest first; what stays busy is detached (`umount -l`). The points
    that were mounted."""
    unmounted: list[str] = []
    for _ in range(UNMOUNT_PASSES):
        points = _mounts_below(list(roots))
        if not points:
            return unmounted
        for point in points:
            subprocess.run(["umount", point], capture_output=True, timeout=30, check=False)
        unmounted += points
    for point in _mounts_below(list(roots)):
        subprocess.run(["umount", "-l", point], capture_output=True, timeout=30, check=False)
    return unmounted


def down() -> list[str]:
    """End the node, pass or fail: every recorded process (the kubelet first, containerd's containers before
    containerd), every mount below the node's directories, and the node's, the kubelet's and containerd's files.
    What was done, a line each."""
    done: list[str] = []
    processes = recorded()
    for name in ("kubelet", "kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd"):
        if name in processes:
            _stop(processes[name])
            done.append(f"stopped {name} (pid {processes[name].pid})")
    killed = _kill_containers()
    if killed:
        done.append(f"killed {killed} container processes")
    if "containerd" in processes:
        _stop(processes["containerd"])
        done.append(f"stopped containerd (pid {processes['containerd'].pid})")
    roots = [KUBELET_ROOT, STATE, RUN]
    done += [f"unmounted {point}" for point in unmount_below(*roots)]
    hosts_line = STATE / "hosts-line"
    if hosts_line.is_file():
        line = hosts_line.read_text()
        HOSTS.write_text(HOSTS.read_text().replace(line, ""))
        done.append(f"removed {line.strip()!r} from {HOSTS}")
    made = STATE / "made-elsewhere.json"
    for path in json.loads(made.read_text()) if made.is_file() else []:
        if Path(path).exists():
            shutil.rmtree(path, ignore_errors=True)
            done.append(f"removed {path}")
    for root in roots:
        if root.exists():
            shutil.rmtree(root, ignore_errors=True)
            done.append(f"removed {root}")
    return done
