"""Speculative decoding: draft tokens cheaply, verify them in one forward of the target model, keep the longest
accepted run plus one token (`speculator.py`); drafts from n-grams (`ngram.py`)."""
