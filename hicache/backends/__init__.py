"""Where pages live: the tier interface (`base`: the one abstract `Tier`, with its two
families, `PoolTier` and `StoreTier`) and every tier behind it: the engine's GPU pool (`gpu`),
the pinned host tier and its memory (`host`, `memory`), the disk and Mooncake store tiers
(`disk/`, `mooncake/`) with what store tiers share (`regions`: registered memory and the checks
of a call against it; `breaker`: the circuit breaker of a remote store), and the format of a
stored object (`envelope`: its header and checksum; `codec`: the lossless codec). Backends
register their YAML ``type:`` with `hicache.registry`. Imports only `hicache.core`,
`hicache.kernels`, `hicache.observability` and the base below it; never `hicache.chain`, the
API, `hicache.integrations` or `hicache.tools`."""
