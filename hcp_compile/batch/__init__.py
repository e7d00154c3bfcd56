"""Host-side batch work, no collectives: the placement rules, the token layout they give, the
prepared batch that carries it (picklable, built in a DataLoader worker or on first use) and
the ring schedule each rank's attention runs (docs/design.md §2, §5.3)."""
