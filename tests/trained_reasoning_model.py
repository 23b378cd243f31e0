"""A tiny Qwen3-style reasoning model that really writes this year's formats, trained once per recipe and cached.

transformers' own `Qwen3ForCausalLM` (hidden 64, 2 layers) with SmolLM2's tokenizer (ChatML: `<|im_start|>`,
`<|im_end|>`) plus `<think>`, `</think>`, `<tool_call>`, `</tool_call>` as normal added tokens, and the Qwen3-style
chat template (tests/chat_templates/qwen3.jinja), is trained with Adam to answer each of `CASES`' exact rendered
prompts with its exact text: thinking then an answer, thinking then a Hermes tool call, thinking then a
Qwen3-Coder XML call, thinking then JSON, and the first question with `enable_thinking: false` (the answer
only). It also learns to answer after a `</think>` that cuts its thinking short (what a thinking budget makes
the engine write), with no loss on where it would have closed the thinking itself, so its greedy thinking stays
whole. After training, transformers' greedy `generate` must give every case's text exactly.

The saved directory (config.json, safetensors, tokenizer files, chat template, and a generation_config.json
with Qwen-like sampling defaults and a short `max_new_tokens`) lives under `$RINGSERVE_CACHE` (default
`~/.cache/ringserve`) in a folder named by a hash of the recipe, so a change to the recipe trains anew; a file
lock makes concurrent test workers wait for the one that trains.

(tests/reasoning_model.py is another helper: the same tokenizer and template on random weights, for tests that
need no particular output.)
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ringserve.actors.common.model_source import cache_root

TEMPLATE = Path(__file__).parent / "chat_templates" / "qwen3.jinja"
ADDED_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
END = "<|im_end|>"

WEATHER_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

# The texts the tests expect: the thinking (markers and the whitespace next to them left out) and the answer
GREETING = "Say hello."
GREETING_THINKING = "The user wants a greeting. I will be brief."
GREETING_ANSWER = "Hello! How can I help?"
WEATHER_QUESTION = "What is the weather in Paris?"
WEATHER_THINKING = "I need the weather tool for Paris."
WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME_QUESTION = "What time is it in Tokyo?"
TIME_THINKING = "Tokyo time needs get_time."
TIME_CALL = "<tool_call>\n<function=get_time>\n<parameter=city>\nTokyo\n</parameter>\n</function>\n</tool_call>"
JSON_QUESTION = "Describe Paris as JSON."
JSON_THINKING = "Paris is a city in France."
JSON_ANSWER = '{"city": "Paris", "country": "France"}'

# generation_config.json: Qwen3's recommended sampling for thinking, and a length short enough that a request
# without max_tokens visibly stops at it (every trained answer with its thinking is longer)
GENERATION_DEFAULTS: dict[str, Any] = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 12}


def thought(thinking: str, answer: str) -> str:
    """A Qwen3 output: the thinking in its markers, then the answer, then the end of the turn."""
    return f"<think>\n{thinking}\n</think>\n\n{answer}{END}"


@dataclass(frozen=True)
class Case:
    """One trained prompt (a chat conversation as the template renders it) and the text the model answers."""

    name: str
    messages: list[dict[str, Any]]
    completion: str
    tools: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    budget_tails: bool = False  # also learn to answer after a thinking cut short at every length


CASES: dict[str, Case] = {case.name: case for case in (
    Case("greeting", [{"role": "user", "content": GREETING}], thought(GREETING_THINKING, GREETING_ANSWER),
         budget_tails=True),
    Case("weather", [{"role": "user", "content": WEATHER_QUESTION}], thought(WEATHER_THINKING, WEATHER_CALL),
         tools=[WEATHER_TOOL]),
    Case("time", [{"role": "user", "content": TIME_QUESTION}], thought(TIME_THINKING, TIME_CALL), tools=[TIME_TOOL]),
    Case("json", [{"role": "user", "content": JSON_QUESTION}], thought(JSON_THINKING, JSON_ANSWER)),
    Case("greeting_no_thinking", [{"role": "user", "content": GREETING}], GREETING_ANSWER + END,
         template_kwargs={"enable_thinking": False}),
)}


@dataclass(frozen=True)
class Training:
    """How the model is built and trained (part of the cache key)."""

    hidden_size: int = 64
    intermediate_size: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    context: int = 1024
    seed: int = 0
    lr: float = 6e-3
    steps: int = 40  # per round; more rounds until every case comes out with a margin (about 80 steps in all)
    max_rounds: int = 10
    min_margin: float = 3.0  # each greedy token's logit over the runner-up, so our engine's rounding cannot flip it
    threads: int = 1  # two OpenMP threads on a busy two-core host spin at barriers: several times slower


TRAINING = Training()
RECIPE_VERSION = 1


def recipe_key() -> str:
    """A hash of everything that decides the saved model: the cases, the training settings, the template."""
    recipe = {"version": RECIPE_VERSION, "cases": [asdict(case) for case in CASES.values()],
              "training": asdict(TRAINING), "template": TEMPLATE.read_text(), "generation": GENERATION_DEFAULTS,
              "added": ADDED_TOKENS}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def reasoning_model_dir() -> Path:
    """The trained model's directory, trained and saved the first time (about a minute on two cores)."""
    root = cache_root() / "test_models"
    root.mkdir(parents=True, exist_ok=True)
    target = root / f"tiny-qwen3-reasoning-{recipe_key()}"
    with open(root / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").is_file():
            return target
        staging = Path(tempfile.mkdtemp(prefix=f"{target.name}.", dir=root))
        try:
            _build(staging)
            staging.chmod(0o755)  # mkdtemp's 0700 would hide it from other users of the cache
            staging.rename(target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return target


def load_reasoning_tokenizer() -> Any:
    """SmolLM2's tokenizer with the thinking and tool-call markers added and the Qwen3-style template."""
    from ringserve.actors.common.model_source import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model("SmolLM2-135M-Instruct"))
    missing = [token for token in ADDED_TOKENS if token not in tokenizer.get_vocab()]
    if missing:
        tokenizer.add_tokens(missing)  # normal (non-special) tokens: they stay in decoded text, as Qwen3's do
    tokenizer.chat_template = TEMPLATE.read_text()
    return tokenizer


def prompt_ids(tokenizer: Any, case: Case) -> list[int]:
    """The case's prompt as the server tokenizes it: the template's text, then its tokens without additions."""
    text = tokenizer.apply_chat_template(case.messages, tools=case.tools, add_generation_prompt=True, tokenize=False,
                                         **case.template_kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


def _examples(tokenizer: Any) -> list[tuple[list[int], list[int]]]:
    """(input ids, labels with -100 where no loss) for every case, and each budget-cut thinking's answer."""
    end_id = tokenizer.convert_tokens_to_ids("</think>")
    examples = []
    for case in CASES.values():
        prompt = prompt_ids(tokenizer, case)
        completion = tokenizer.encode(case.completion, add_special_tokens=False)
        examples.append((prompt + completion, [-100] * len(prompt) + completion))
        if case.budget_tails:
            start = completion.index(tokenizer.convert_tokens_to_ids("<think>")) + 1
            close = completion.index(end_id)
            tail = completion[close + 1:]
            for cut in range(start + 1, close):  # at least one thinking token, the engine's `</think>` right after
                head = prompt + completion[:cut] + [end_id]
                examples.append((head + tail, [-100] * len(head) + tail))
    return examples


def _batch(examples: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[Any, Any, Any]:
    import torch

    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, (seq, target) in enumerate(examples):
        ids[row, :len(seq)] = torch.tensor(seq)
        labels[row, :len(seq)] = torch.tensor(target)
        mask[row, :len(seq)] = 1
    return ids, labels, mask


def _scored_logits(model: Any, ids: Any, labels: Any, mask: Any) -> tuple[Any, Any]:
    """The logits at the labelled positions only, and their targets: the whole batch's logits over a 49k
    vocabulary would be most of the training's time and memory."""
    hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1]
    targets = labels[:, 1:]
    scored = targets != -100
    return model.lm_head(hidden[scored]).float(), targets[scored]


def _worst_margin(model: Any, ids: Any, labels: Any, mask: Any) -> float:
    """The smallest margin of a labelled token's logit over the best other token (negative: greedy errs)."""
    import torch

    with torch.no_grad():
        logits, targets = _scored_logits(model, ids, labels, mask)
    chosen = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    others = logits.scatter(-1, targets.unsqueeze(-1), float("-inf")).amax(-1)
    return float((chosen - others).min())


def _build(directory: Path) -> None:
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    previous_threads = torch.get_num_threads()
    torch.set_num_threads(TRAINING.threads)
    try:
        tokenizer = load_reasoning_tokenizer()
        torch.manual_seed(TRAINING.seed)
        t = TRAINING
        config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=t.hidden_size,
                             intermediate_size=t.intermediate_size, num_hidden_layers=t.layers,
                             num_attention_heads=t.heads, num_key_value_heads=t.kv_heads, head_dim=t.head_dim,
                             max_position_embeddings=t.context, tie_word_embeddings=True,
                             bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
        model = Qwen3ForCausalLM(config)
        ids, labels, mask = _batch(_examples(tokenizer), tokenizer.pad_token_id)
        optimizer = torch.optim.Adam(model.parameters(), lr=t.lr)
        for _ in range(t.max_rounds):
            model.train()
            for _ in range(t.steps):
                logits, targets = _scored_logits(model, ids, labels, mask)
                loss = torch.nn.functional.cross_entropy(logits, targets)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            model.eval()
            if _worst_margin(model, ids, labels, mask) >= t.min_margin:
                break
        _check_greedy(model, tokenizer)
        model.generation_config = GenerationConfig(
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, do_sample=True, **GENERATION_DEFAULTS)
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
    finally:
        torch.set_num_threads(previous_threads)


def _check_greedy(model: Any, tokenizer: Any) -> None:
    """transformers' greedy generate gives every case's text exactly; AssertionError naming the case otherwise."""
    import torch

    for case in CASES.values():
        prompt = torch.tensor([prompt_ids(tokenizer, case)])
        with torch.no_grad():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                 max_new_tokens=len(tokenizer.encode(case.completion)) + 8,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        text = tokenizer.decode(out[0, prompt.shape[1]:])
        assert text == case.completion, f"the tiny reasoning model answers {case.name!r} with {text!r}"
