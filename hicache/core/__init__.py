"""The request's own state, independent of where pages live: keys (`keys`), slot books with
their pins and eviction (`slots`, `eviction`, `native`), the cost model and the partial-fetch
plan (`cost`, `plan`), the `Match` answer (`request`) and worker-thread placement (`threads`).
Imports nothing from `hicache.tiers`, `hicache.transfer` or `hicache.integrations`."""
