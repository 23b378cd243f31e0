"""The actors of the request ring (entry, tokenizer, scheduler, detokenizer), the engine the scheduler
drives, and the launcher that runs them as separate processes."""
