"""The ring's actors and bus: the NATS codec and subjects, actor runtime and liveness, the tokenizer and
detokenizer actors, process and OS hygiene."""
