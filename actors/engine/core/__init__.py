"""The step's data, at the bottom of the engine: requests (`request.py`), the batch a step runs and what its
forward returns (`batch.py`), the embeddings written over a step's image tokens (`embed_override.py`), what an
embedding request keeps between chunks (`embedding.py`) and a request's reasoning gate (`reasoning_gate.py`).

It imports no other engine sub-package; `models/`, `runner/`, `speculative/` and the rest build on it, and
`scheduling/` sits on top (tests/engine/test_engine_import_layers.py).
"""
