"""Fixtures of the fault tests. The tiny random-weight model (`tiny_model_dir`) that starts a whole ring in
seconds lives in tests/conftest.py, shared with the tracing tests."""
