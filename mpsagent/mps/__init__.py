"""The MPS adapter: paths under the MPS root and the locks, the control commands (`commands`, pure) and the
channel that sends them, starting a daemon, the agent's daemon supervisor, the daemon host's keeper, the daemon
state file and the daemon's log."""
