"""What hicache reports: counters and latency histograms (`stats`), their Prometheus export
(`metrics`) and KV events for an engine's router (`events`)."""
