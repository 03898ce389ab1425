"""A rack on one machine: N agents, each on a node no kubelet runs, against the e2e node's API server and scheduler
(`mpsagent_testing.cluster`), for `bench/rack.py` and `tests/e2e/test_e2e_rack.py`.

- `rest` — the API server as its administrator, without kubectl: kept connections, and `Informer` (list and watch);
- `nodes` — the kubelet-less Nodes, made and kept Ready (their Leases renewed as a kubelet's heartbeat);
- `agents` — the agents, each with its own fake NVML of 8 GPUs, directories, MPS daemon and service account; a
  device-plugin grant made through the grpcio kubelet stand-in;
- `kubelet` — the kubelet's DRA calls for the rack's nodes: each placed pod's claim prepared, a deleted pod's
  unprepared;
- `workload` — the pods and their claims of random sizes;
- `capacity` — every device's use from the slices and the claims' allocations, checked at each change;
- `audit` — each agent's requests, from the API server's audit log;
- `rack` — all of it together, up for a block and ended after it."""
