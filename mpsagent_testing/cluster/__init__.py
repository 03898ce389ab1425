"""A real single-node Kubernetes for the end-to-end tests: upstream kube-apiserver, kube-controller-manager,
kube-scheduler and kubelet built from their published Go modules, with Debian's etcd, containerd, runc and CNI
plugins, on loopback, GPU-less. `scripts/e2e-cluster` is its command line (`python -m mpsagent_testing.cluster`).

- `layout` — the pinned versions, the Kubernetes releases the node runs and the one chosen, and every path the node
  uses (cache, state, sockets, logs);
- `build` — the binaries, built once into the cache, Kubernetes' from its release's wrapper module in
  `gomod/v1.<minor>/`; `wrapper_module` — that module made from the release's own go.mod, for a release or patch
  just added to the table;
- `images` — the sandbox and busybox images, made from Debian's busybox-static, and importing images into
  containerd;
- `node` — starting the node (`up`), its state, a real kubelet restart, and `down`, which ends every process it
  started and removes every mount and file;
- `kubectl` — the tests' way to the API server;
- `pods` — the tests' busybox pods that print what they were given;
- `host_agent` — the agent as a host process on the node, on fake GPUs; `kube_route` — the node made ready for
  the DaemonSets, the test overlay and Helm values; `noop_plugin` — a device plugin that does nothing (the bench's
  baseline).

The modules `scripts/e2e-cluster` runs (`layout`, `build`, `wrapper_module`, `images`, `node`, `__main__`,
and `mpsagent_testing.repo`) use only the standard library: it runs before any virtual environment exists. The others
need the test extra."""
