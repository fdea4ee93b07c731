"""The Mooncake Store tier (`tier`)."""
