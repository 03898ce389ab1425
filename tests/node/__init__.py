"""What the agent tells the node (`mpsagent.node`): node-feature-discovery labels and systemd's notify protocol."""
