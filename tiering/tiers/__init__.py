"""The kit every secondary tier builds on: the seed's tier interface, the actor (inbox,
ledger, I/O threads), the client and its outcome, the registry, the residency index and
the block record every stored block carries."""
