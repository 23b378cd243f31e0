"""How many prompt tokens a step may prefill so that it stays short, learned from the steps as they run.

A request that arrives while a long prompt is prefilled in chunks waits for the step in flight, is prefilled in
the next (actors/engine/scheduling/prefill.py), and then decodes one token per step beside the chunks: its
latency is about (its tokens + 2) steps, so it is bounded only as long as a step is. A chunk of a fixed size is
short on a quiet host and long on a busy one: SmolLM2 with 512-token chunks took 5-35 s per step at a load
average of 11 on 2 cores, and a 4-token chat beside a 7k-token prompt took 43 s (issue 53). So the chunk the
chunked prompts get per step (and the first chunk of a prompt that starts being chunked) is cut to what
`target` seconds of prefill allow (while other requests share the steps; `alone_target` for a prompt
prefilled alone, so a quiet host keeps whole chunks for its time to first token) at the seconds per token
recent prefill steps took: a power of two (the
thread tuner learns per power-of-two step size), at least `floor` tokens, at most the configured chunk.

The cost is a moving average of whole steps' seconds per token (decode rows and attention included), over
steps of at least `floor` tokens; it follows the host's load and the context's growth. A slower step lowers
the next steps' chunk, so a host that gets busy is followed within a step or two; a step of `floor` tokens
that still takes longer than `target` is as short as chunking makes it.
"""

from __future__ import annotations

TARGET_STEP_SECONDS = 1.0  # a short request's latency is a few steps: a few seconds on any host
ALONE_TARGET_STEP_SECONDS = 4.0  # a prompt prefilled alone: whole chunks on a quiet host (its time to first
# token), yet a request that comes meanwhile waits for one step of at most this long
FLOOR_TOKENS = 64  # smaller chunks would pay a whole step's fixed cost for little progress
SMOOTHING = 0.5  # weight of the newest step in the moving average


class StepPace:
    """Learns seconds per prefill token (`record`) and sizes chunks from it (`chunk`)."""

    def __init__(self, target: float = TARGET_STEP_SECONDS, floor: int = FLOOR_TOKENS,
                 alone_target: float = ALONE_TARGET_STEP_SECONDS) -> None:
        self.target = target
        self.alone_target = alone_target
        self.floor = floor
        self.cost: float | None = None  # seconds per token of recent prefill-sized steps (None: none yet)

    def record(self, num_tokens: int, seconds: float) -> None:
        """A step of `num_tokens` tokens took `seconds` (steps smaller than `floor` tokens are not counted:
        a decode step's cost is mostly fixed, not per token)."""
        if num_tokens < self.floor or seconds <= 0:
            return
        per_token = seconds / num_tokens
        self.cost = per_token if self.cost is None else self.cost + SMOOTHING * (per_token - self.cost)

    def chunk(self, chunk_size: int, shared: bool = True) -> int:
        """The chunk to prefill this step instead of `chunk_size` (`chunk_size` until a step was measured);
        `shared`: other requests share the steps (else the looser `alone_target` bounds the step)."""
        if self.cost is None or chunk_size <= self.floor:
            return chunk_size
        fits = int((self.target if shared else self.alone_target) / self.cost)
        if fits >= chunk_size:
            return chunk_size
        return max(self.floor, 1 << max(fits, 1).bit_length() - 1)  # the power of two at or below
