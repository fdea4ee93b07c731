"""refengine: a small reference inference engine that embeds hicache through its public API.

It exists to prove hicache end to end (cache hits give the same tokens as recomputing) and to
measure what the cache buys (`hicache replay`). hicache never imports it.
"""
