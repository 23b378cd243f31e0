"""Multi-LoRA serving: PEFT adapters loaded and checked (`adapter.py`), run batched on top of any base linear
(`lora_linear.py`), and held in a bounded pool of per-step slots (`pool.py`)."""
