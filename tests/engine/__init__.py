"""The engine in process: the execution plan, batching, chunked prefill, the prefix cache and KV events/tier/pool,
sampling, stops, overlap, speculative decoding, decode graphs, determinism, weight swaps."""
