"""The decisions, as plain synchronous code with no I/O: what is advertised (`plan`), how much of a GPU a grant gets
(`shares`), who holds what (`ledger`, `reconcile`), preferred allocations (`placement`), what a container is given
(`container`), the allocator the RPCs call (`allocation`), the advertised replicas' health (`inventory`, `health`)."""
