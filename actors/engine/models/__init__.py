"""The models the engine runs: the architecture families of the model catalog (actors/common/model_catalog.py),
one file per family declaring an `ArchSpec` (`spec.py`), the shared blocks they are built from (`blocks.py`,
`rope.py`, `causal_lm.py`, whose `CausalLM` is the interface the rest of the engine uses), reading their weights
from safetensors or GGUF, GGUF block formats, and swapping weights in place. docs/models.md says how to add an
architecture."""
