"""The kubelet floor (`mpsagent.kubelet`): the node guard, the request wire's limits, and reconciliation with
pod-resources."""
