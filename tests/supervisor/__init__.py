"""The supervisor (`mpsagent.supervisor`): the claim server, the daemon host and its keeper, the caps a resource's
server keeps to the ledger, and the stowaway watch."""
