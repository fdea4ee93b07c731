"""The machinery that walks the store tiers and feeds them: the walk down them for one request
(`walk`: `TierChain`), one link per store tier (`link`: `StoreLink`, with its fetches, `fetch`,
and its write-behind and write-back, `writes`) and what the link's worker threads do with a
store job (`jobs`: get, put, probe, with the object envelope and codec). Imports the backends,
the kernels' completions, `hicache.core` and the base below it; never the API
(`hicache.cache`, `match`, `store`), `hicache.integrations` or `hicache.tools`."""
