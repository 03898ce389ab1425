"""The running agent: the one task group and its start order (`app`), one server per resource (`resource_server`), the
state publisher (`publisher`), the stop signals (`stop_signals`), and `--daemon-host` (`daemon_host`)."""
