"""Where pages live below the engine's GPU pool: the tier interface (`base`; backends register
with `hicache.registry`), the host tier and its memory, the GPU pool's view (`gpu`), and the
store tiers: the walk down them (`chain`), one link per store tier (`link`: fetch, write-behind,
reserve) with its worker threads (`worker`), and the backends (`disk`, `mooncake`). Never
imports the API (`hicache.cache`, `match`, `store`), `hicache.integrations` or `hicache.tools`."""
