"""Serving benchmarks for ringserve (and any OpenAI-compatible server); the entry point is `bench_serving.py`."""
