"""The signals that stop the agent and the daemon host: SIGTERM, SIGINT and SIGHUP. SIGHUP stops as SIGTERM does:
there is nothing to reload in place (a new configuration means a new plan, new daemons), and a hang-up must not end
a process without its clean-up."""

from __future__ import annotations

import signal

import anyio

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


async def wait_stop_signal() -> signal.Signals:
    """Return the first stop signal received."""
    with anyio.open_signal_receiver(*STOP_SIGNALS) as signals:
        return signal.Signals(await anext(signals))
