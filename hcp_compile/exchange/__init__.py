"""What moves between ranks: the ``("ring", "ulysses")`` mesh and its groups, the collectives
(all-to-all, ring hops, the agreement before the first one) and the collective schemes that
carry KV round the ring (docs/design.md §3.2, §3.3, §9)."""
