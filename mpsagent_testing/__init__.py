"""Test support for mpsagent, in the spirit of `trio.testing`: the stand-ins and helpers that tests/, bench/ and
scripts/hardware_check.py share. A distribution of its own (testing/pyproject.toml, `pip install -e ./testing`;
its dependencies grpcio, grpcio-tools, hypothesis and pytest), so that the agent's distribution carries the agent
only; nothing in `mpsagent` imports it (an import-linter contract).

- `repo` — where the checkout's files are;
- `domain` — the agent's domain values for unit tests, built as the agent builds them: GPUs, a node of them, the
  plan of a config, a resource's shares;
- `node` — the node the tests describe (GPU UUIDs, replica IDs, the snapshot and config files);
- `agents` — the agent as a real process (`AgentLauncher`) and the usual ways to start it;
- `kubelet` — grpcio stand-ins for the kubelet: the registration server (`fake`), pod-resources
  (`podresources`), the device-plugin calls a kubelet makes (`calls`);
- `kube_api` — the Kubernetes API server's objects (a claim, the node, its slice) and the agent's API client over a
  mock transport;
- `cluster` — the real single-node Kubernetes of the e2e tests; `rack` — N agents on its API server, each on a node
  no kubelet runs, for the rack bench and its test;
- `nvml` — the fake `libnvidia-ml.so.1` (`build`) and what drives it from outside (`control`);
- `mps` — the real control daemon's front-end for tests (`daemon`) and a fake `nvidia-cuda-mps-control` for faults;
- `cuda_torch` — a stand-in `torch` for the GPU share bench's clients;
- `packaging` — what the packaged manifests must hold, and packaging/'s scripts as modules;
- `web` — the agent's HTTP server reading a request head alone;
- `processes` — finding and ending what a test started; `waiting` — the one bounded wait for a condition;
  `metrics` — reading `/metrics`;
  `strategies` — hypothesis strategies for untrusted documents.
A new fake goes here, in the module of the system it stands in for; it uses the agent's public names only."""
