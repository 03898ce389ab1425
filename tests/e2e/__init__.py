"""The agent's scenarios on the real single-node Kubernetes (`mpsagent_testing.cluster`; docs/e2e.md)."""
