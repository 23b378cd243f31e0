"""How many torch threads a decode-sized step should use, learned from the steps themselves as they run.

On a small CPU machine the scheduler shares its cores with the rest of the ring (entry, tokenizer,
detokenizer, NATS), which work on every token. A step on every core is fastest when it has the machine to
itself, but a torch thread that loses its core stalls every parallel region of the step; on one core fewer,
the step is slower but never waits. Which wins depends on the CPU, the model, the kernels (float32 GEMMs or
int8) and the batch, and only shows under the real load, so it is measured online, not at start-up: the
serving benchmark on a 2-core AVX2 machine found int8 decode at 32 streams 33% faster on one thread, float32
at 32 streams ~10% faster on two.

Steps are grouped by size (powers of two of their token count); for each group the tuner keeps a moving
average of the seconds per token of each thread count, tries every count a few times first, then runs the
cheaper one and re-tries the other every `explore_every` steps of the group, for `EXPLORE_RUN` steps in a
row, so it follows drift (longer contexts, other load). The first step after the count changed is not
counted: it pays for the switch (measured in serving: single re-tries kept a one-stream `gguf` decode on two
threads at 22 ms per token, against 14 ms on one). When a decode graph becomes ready the runner makes the
tuner forget (`forget`): what it learnt timed the eager forward, under the compile's load (in one serving
run, steps timed during the warm-up's compiles kept one stream on one thread at 15 ms per step, against 9.5
on two). Steps of `large_from_tokens` tokens or more (prefill chunks) are learned too, but each count is
tried once and a re-try lasts one step, counted though it follows a switch: a switch costs little beside a
chunk, while a chunk on the slower count costs a whole chunk's time. A chunk runs on the fewest threads unless
more measured `LARGE_MARGIN` cheaper, since the two mistakes differ in cost. They used to run on every core always,
which is fastest on a quiet host and far slowest on a busy one (issue 53: SmolLM2, one 512-token chunk at a
load average of 14 on 2 cores took 37 s on two threads and 7 s on one; bench/head_of_line.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

WARMUP_STEPS = 3  # samples of each option before trusting the averages
EXPLORE_EVERY = 50  # steps of a group between re-tries of the option not in use
EXPLORE_RUN = 4  # steps a re-try lasts
SMOOTHING = 0.3  # weight of the newest sample in the moving averages
LARGE_STEP_TOKENS = 64  # steps with at least this many tokens (prefill chunks): one try each, one-step re-tries
# a chunk runs on more than the fewest threads only when that measured this much cheaper: a wrong choice of
# more threads costs a busy host several times a chunk, a wrong choice of fewer at most the thread ratio
LARGE_MARGIN = 0.8


def startup_threads(config: Any) -> int:
    """The torch threads a scheduler process starts with: `--torch-threads`, or every core when it is 0."""
    return config.torch_threads or os.cpu_count() or 1


def tuner_for(config: Any, cores: int | None = None) -> ThreadTuner | None:
    """The thread policy `--torch-threads` asks for: with 0 on a multi-core CPU, steps run on all cores or all
    but one, whichever this tuner measures faster per step size (the other actors work on every token, and a
    torch thread that loses its core stalls every parallel region). Any other value fixes the count (None: no
    tuner)."""
    cores = cores or os.cpu_count() or 1
    if config.torch_threads != 0 or cores < 2 or config.resolved_device() != "cpu":
        return None
    return ThreadTuner((cores - 1, cores), LARGE_STEP_TOKENS)


@dataclass
class _Group:
    steps: int = 0
    exploring: int = 0  # steps of the current re-try still to run
    samples: dict[int, int] = field(default_factory=dict)
    cost: dict[int, float] = field(default_factory=dict)  # seconds per token, moving average


class ThreadTuner:
    """Chooses a thread count per step (`choose`) and learns from how long it took (`record`)."""

    def __init__(self, options: tuple[int, ...], large_from_tokens: int, explore_every: int = EXPLORE_EVERY,
                 warmup: int = WARMUP_STEPS) -> None:
        """`large_from_tokens`: steps of this many tokens or more are prefill chunks (the module docstring)."""
        if not options or min(options) < 1:
            raise ValueError(f"thread options must be positive, got {options}")
        self.options = tuple(sorted(set(options)))
        self.large_from_tokens = large_from_tokens
        self.explore_every = explore_every
        self.warmup = warmup
        self._groups: dict[int, _Group] = {}
        self._last_threads: int | None = None  # the previous step's count

    def choose(self, num_tokens: int) -> int:
        """The thread count for a step of `num_tokens` tokens."""
        if len(self.options) == 1:
            return self.options[0]
        large = num_tokens >= self.large_from_tokens
        group = self._groups.setdefault(num_tokens.bit_length(), _Group())
        group.steps += 1
        for option in self.options:
            if group.samples.get(option, 0) < (1 if large else self.warmup):
                return option
        ranked = self._ranked(group, large)
        if group.steps % self.explore_every == 0:
            group.exploring = 1 if large else EXPLORE_RUN
        if group.exploring:
            group.exploring -= 1
            return ranked[1]
        return ranked[0]

    def record(self, num_tokens: int, threads: int, seconds: float) -> None:
        """A step of `num_tokens` tokens took `seconds` on `threads` threads."""
        switched, self._last_threads = threads != self._last_threads, threads
        if (switched and num_tokens < self.large_from_tokens) or num_tokens <= 0 or threads not in self.options:
            return
        group = self._groups.setdefault(num_tokens.bit_length(), _Group())
        per_token = seconds / num_tokens
        seen = group.samples.get(threads, 0)
        group.samples[threads] = seen + 1
        old = group.cost.get(threads)
        group.cost[threads] = per_token if old is None else old + SMOOTHING * (per_token - old)

    def _ranked(self, group: _Group, large: bool) -> list[int]:
        """The options, the one to run first (cheapest; for a chunk, the fewest threads unless clearly beaten)."""
        ranked = sorted(self.options, key=lambda o: group.cost[o])
        if large and group.cost[ranked[0]] > LARGE_MARGIN * group.cost[self.options[0]]:
            ranked = [self.options[0], *[o for o in ranked if o != self.options[0]]]
        return ranked

    def forget(self) -> None:
        """Drop what was learnt (every size tries every count again): the steps it came from ran another
        forward, e.g. eagerly before a compiled decode graph was ready, and under the compile's load."""
        self._groups.clear()

    def preferred(self) -> dict[str, int]:
        """The thread count each learned step size runs on, e.g. {"16-31 tokens": 2} (for logs and stats)."""
        out = {}
        for bits, group in sorted(self._groups.items()):
            low, high = 1 << (bits - 1), (1 << bits) - 1
            if all(group.samples.get(o, 0) >= (1 if low >= self.large_from_tokens else self.warmup)
                   for o in self.options):
                out[f"{low}-{high} tokens"] = self._ranked(group, low >= self.large_from_tokens)[0]
        return out
