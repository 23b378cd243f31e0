"""The native APIs of the servers ringserve stands in for: SGLang's `/generate` with its `meta_info`, and vLLM's and
SGLang's `/v1/tokenize` and `/v1/detokenize`."""
