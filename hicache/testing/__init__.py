"""A deterministic simulation of hicache under faults (`python -m hicache.testing.sim`).

It drives the real `HiCache` (and the real vLLM connector pair) with its real tiers, while
time, the device's copies, the store tiers' calls and their faults are the simulation's: one
seeded random generator decides all of it, so a failing seed reproduces exactly. An oracle
checks every byte the engine loads and the cache's books after every step. See
docs/simulation.md.
"""
