"""OpenAI's API: chat completions, completions, models and embeddings (request parsing, routes, response bodies,
streamed chunks, logprobs)."""
