"""The agent as a whole: a real process driven over its sockets and its command line (`--once`, `--status`), with
hostile and arbitrary input, and for long."""
