"""Tiers: the interface (`base`), the registry, and one module per backend."""
