"""The MPS adapter: paths under the MPS root, the control-command channel, and the daemon supervisor."""
