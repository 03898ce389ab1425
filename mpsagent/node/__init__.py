"""What the agent tells the node: systemd's notify protocol (`systemd`) and node-feature-discovery labels (`nfd`)."""
