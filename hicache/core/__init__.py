"""The request's own state, independent of where pages live: keys (`keys`), slot books with
their pins and eviction (`slots`, `eviction`, `native`), the cost model and the partial-fetch
plan (`cost`, `plan`) and the `Match` answer (`request`). Imports nothing but `hicache.config`
below it: not `hicache.backends`, `hicache.kernels`, `hicache.chain` or `hicache.integrations`."""
