"""The operator's side of the entry: control routes (cache, pause, abort, weights, LoRA adapters) and the
Prometheus metrics: the request-level series, the scrape route and other servers' metric names."""
