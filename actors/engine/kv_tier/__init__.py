"""The KV cache's second tier: prefix blocks the pool evicts go to a bounded host-memory or disk store
(`--kv-tier-bytes`, `--kv-tier-dir`), and a later request whose prompt continues past its cached prefix with
blocks the store holds loads them instead of computing them (`store.py` keeps the bytes, `tier.py` moves them
between the store and the KV pool)."""
