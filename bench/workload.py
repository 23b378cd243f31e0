"""The benchmark's fixed, deterministic workload: chat prompts and an optional shared long system prompt.

Every run (server, transformers baseline, engine baseline) sends the same messages in the same order, so
their throughputs compare like for like.
"""

from __future__ import annotations

TOPICS = [
    "the ocean", "photosynthesis", "autumn leaves", "friendship", "a busy city street", "how airplanes fly",
    "volcanoes", "the history of bread", "honeybees", "the moon landing", "rainforests", "electric cars",
    "chess openings", "the water cycle", "ancient Rome", "learning a new language",
]
TASKS = [
    "Tell me about {}.", "Explain {} to a ten-year-old.", "Write a short poem about {}.",
    "List three surprising facts about {}.", "Describe {} in a few sentences.",
    "What are the pros and cons of {}?", "Write a short story that involves {}.",
    "Give me a one-paragraph summary of {}.",
]

# Filler for the shared system prompt: numbered house rules, deterministic and varied enough to tokenize
# like ordinary English (about 1.45 tokens per word with SmolLM2's tokenizer).
_RULE_SUBJECTS = ["answers", "examples", "lists", "summaries", "explanations", "stories", "poems", "facts"]
_RULE_VERBS = ["should stay", "must remain", "ought to be", "are best kept", "need to be", "are expected to be"]
_RULE_QUALITIES = ["short and clear", "polite and friendly", "accurate and careful", "simple and direct",
                   "well organised", "free of jargon", "honest about uncertainty"]
TOKENS_PER_WORD = 1.45


def user_prompt(i: int) -> str:
    """The i-th user prompt; the first len(TOPICS) * len(TASKS) are all different."""
    a, b = divmod(i, len(TOPICS))
    return TASKS[(a + b) % len(TASKS)].format(TOPICS[b])


def system_prompt(approx_tokens: int) -> str:
    """A deterministic system prompt of roughly `approx_tokens` tokens ("" for 0)."""
    if approx_tokens <= 0:
        return ""
    words = ["You are a helpful assistant. Follow these house rules."]
    count, k = len(words[0].split()), 0
    while count * TOKENS_PER_WORD < approx_tokens:
        rule = (f"Rule {k + 1}: {_RULE_SUBJECTS[k % len(_RULE_SUBJECTS)]} "
                f"{_RULE_VERBS[k % len(_RULE_VERBS)]} {_RULE_QUALITIES[k % len(_RULE_QUALITIES)]}.")
        words.append(rule)
        count += len(rule.split())
        k += 1
    return " ".join(words)


def conversation(i: int, system: str = "") -> list[dict[str, str]]:
    """The chat messages of request i (with the shared system prompt first when there is one)."""
    messages = [{"role": "system", "content": system}] if system else []
    return messages + [{"role": "user", "content": user_prompt(i)}]


def requests_for_level(concurrency: int, num_prompts: int, rounds: int) -> int:
    """How many requests a concurrency level sends: min(num_prompts, rounds × c), but at least c."""
    return max(concurrency, min(num_prompts, rounds * concurrency))


def level_conversations(n: int, system: str = "") -> list[list[dict[str, str]]]:
    """The first n conversations of the prompt set (cycling when n exceeds the distinct prompts)."""
    distinct = len(TOPICS) * len(TASKS)
    return [conversation(i % distinct, system) for i in range(n)]
