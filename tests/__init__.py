"""The tests, by area: a folder per package of the agent (`base/`, `domain/`, `documents/`, `mps/`, `gpu/`, `kubelet/`,
`deviceplugin/`, `dra/`, `node/`, `web/`, `supervisor/`, `proto/` for `_proto/`), `agent/` for the agent as a whole
process and its command line, `packaging/` for the packaging, the docs and the architecture, `tools/` for bench/ and
scripts/, and `e2e/` on the real node. What they share is in `mpsagent_testing`; no test module imports another."""
