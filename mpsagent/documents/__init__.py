"""What the agent tells people and monitors: the status document (`status_document`, built and printed by `status`),
the `--once` report (`report_document`, `report`) and the Prometheus metrics read from the status document
(`metrics`)."""
