"""Every architecture family through the whole ring (HTTP entry, tokenizer, scheduler, detokenizer over real NATS)
against transformers: a tiny random model of each family (tests/model_families.py) with SmolLM2's 49152-token
vocabulary and tokenizer, saved as a directory and served. Greedy `/generate` tokens of batched prompts that cross
the sliding windows and the rope-scaled models' original context equal transformers' greedy ones, and prompt
logprobs equal transformers' log-softmax. Qwen 3, Gemma 3, Qwen3-MoE and DeepSeek-V2 with `--tp 2`, and
Qwen2-MoE with whole experts per rank (`--tp 2 --ep 2`), give transformers' tokens too, and
Qwen 3 with `--quantization int8`/`int4`/`auto` gives the tokens of an in-process engine quantized the same way. A
directory of an architecture no family serves is refused in one line naming it and the served ones.

Phi-3's prompts stay within its original context: longrope's factors are chosen per token here and per forward
in transformers, which differ for a prompt that crosses it (actors/engine/models/rope.py)."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Iterator
from unittest.mock import patch

import httpx
import pytest
import torch

from tests.engine_helpers import assert_greedy_matches, greedy, hf_greedy, run_to_completion, tokens_of
from tests.model_families import CONFIGS, ORIGINAL_CONTEXT, WINDOW, tiny_hf_model
from tests.server_helpers import ServerHandle, server_info, servers_side_by_side
from tests.launcher.test_docs_claims import ringserve_cmd

VOCAB = 49152  # SmolLM2's tokenizer
NEW_TOKENS = 12
# Batched prompts: within a window, across two windows, and past the original context of llama3/phi3 (with
# the new tokens, the third crosses it while decoding; the fourth already in its prefill)
LENGTHS = (3, 2 * WINDOW + 1, ORIGINAL_CONTEXT - 4, ORIGINAL_CONTEXT + 3)

COMMON_FLAGS = ["--torch-threads", "1", "--max-total-tokens", "2048"]
# Servers started side by side (a start mostly waits on imports), a group at a time to bound memory and CPU
GROUPS: list[dict[str, tuple[str, list[str]]]] = [
    {"llama3": ("llama3", []), "mistral": ("mistral", []), "qwen2": ("qwen2", [])},
    {"qwen3": ("qwen3", []), "gemma2": ("gemma2", []), "phi3": ("phi3", [])},
    {"gemma3": ("gemma3", []), "qwen3-int8": ("qwen3", ["--quantization", "int8"]),
     "qwen3-int4": ("qwen3", ["--quantization", "int4"])},
    # auto measures int8's plan as int8 does: never side by side with it, or the two would race to cache it
    {"qwen3-auto": ("qwen3", ["--quantization", "auto"]), "qwen3-tp2": ("qwen3", ["--tp", "2"]),
     "gemma3-tp2": ("gemma3", ["--tp", "2"])},
    {"mixtral": ("mixtral", []), "qwen2_moe": ("qwen2_moe", []), "qwen3_moe": ("qwen3_moe", []),
     "deepseek_v2": ("deepseek_v2", []), "deepseek_v3": ("deepseek_v3", [])},
    {"qwen3_moe-tp2": ("qwen3_moe", ["--tp", "2"]), "qwen2_moe-ep2": ("qwen2_moe", ["--tp", "2", "--ep", "2"]),
     "deepseek_v2-tp2": ("deepseek_v2", ["--tp", "2"])},
    {"smollm3": ("smollm3", []), "olmo2": ("olmo2", []), "olmo3": ("olmo3", []), "exaone4": ("exaone4", [])},
    {"seed_oss": ("seed_oss", []), "ernie4_5": ("ernie4_5", []), "glm4_moe": ("glm4_moe", [])},
]
SERVED = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma2ForCausalLM",
          "Gemma3ForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
          "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "SmolLM3ForCausalLM", "Olmo2ForCausalLM",
          "Olmo3ForCausalLM", "Exaone4ForCausalLM", "SeedOssForCausalLM", "Ernie4_5ForCausalLM", "Glm4MoeForCausalLM"]


def tiny_family_model(family: str) -> Any:
    """`family`'s tiny random transformers model (tests/model_families.py `tiny_hf_model`, its weights drawn the
    same way) with SmolLM2's vocabulary, so the real tokenizer and detokenizer serve it."""
    base = CONFIGS[family]

    def with_vocab() -> Any:
        config = base()
        config.vocab_size = VOCAB
        return config

    with patch.dict(CONFIGS, {family: with_vocab}):
        return tiny_hf_model(family)


def save_family_model(family: str, directory: Path) -> Any:
    """Save `family`'s tiny model with the real SmolLM2 tokenizer into `directory` (as tests/server_helpers.py
    `save_tiny_model` does); returns the transformers model."""
    from ringserve.actors.common.model_source import load_tokenizer, resolve_model

    model = tiny_family_model(family)
    model.save_pretrained(directory)
    load_tokenizer(resolve_model("SmolLM2-135M-Instruct")).save_pretrained(directory)
    return model


def prompts(lengths: tuple[int, ...], seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


class Rings:
    """The module's servers: each case's ring is started with the rest of its group when first asked for, and
    the previous group is stopped then (the tests run in GROUPS order)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.models: dict[str, Any] = {}
        self.dirs: dict[str, Path] = {}
        self.handles: dict[str, ServerHandle] = {}
        self.group: ExitStack | None = None

    def model(self, family: str) -> Any:
        """The transformers model of `family`, saved once for every ring that serves it."""
        if family not in self.models:
            self.dirs[family] = self.root / family
            self.models[family] = save_family_model(family, self.dirs[family])
        return self.models[family]

    def server(self, case: str) -> ServerHandle:
        if case not in self.handles:
            self.close()
            [group] = [g for g in GROUPS if case in g]
            for family, _ in group.values():
                self.model(family)
            self.group = ExitStack()
            specs = {name: (str(self.dirs[family]), [*COMMON_FLAGS, *flags]) for name, (family, flags) in group.items()}
            self.handles = self.group.enter_context(servers_side_by_side(specs))
        return self.handles[case]

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group, self.handles = None, {}


@pytest.fixture(scope="module")
def rings(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rings]:
    pool = Rings(tmp_path_factory.mktemp("families"))
    yield pool
    pool.close()


def generate(server: ServerHandle, prompt_ids: list[int], **extra: Any) -> dict[str, Any]:
    body = {"input_ids": prompt_ids, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0,
                                                         "ignore_eos": True}, **extra}
    response = httpx.post(server.base_url + "/generate", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def served_greedy(server: ServerHandle, seqs: list[list[int]]) -> list[list[int]]:
    """The ring's greedy tokens for `seqs`, sent at once so they share batches."""
    with ThreadPoolExecutor(len(seqs)) as pool:
        return [reply["output_ids"] for reply in pool.map(lambda ids: generate(server, ids), seqs)]


def assert_transformers_tokens(family: str, hf: Any, server: ServerHandle) -> None:
    seqs = prompts(LENGTHS)
    for ids, got in zip(seqs, served_greedy(server, seqs)):
        assert_greedy_matches(hf, ids, hf_greedy(hf, ids, NEW_TOKENS, None), got)


FAMILIES = sorted(CONFIGS, key=lambda f: next(i for i, g in enumerate(GROUPS) if f in g))
TP_CASES = [case for group in GROUPS for case, (_, flags) in group.items() if "--tp" in flags]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_and_prompt_logprobs_equal_transformers(family: str, rings: Rings) -> None:
    server, hf = rings.server(family), rings.model(family)
    assert_transformers_tokens(family, hf, server)

    ids = prompts(LENGTHS[-1:], seed=2)[0]
    reply = generate(server, ids, return_logprob=True, logprob_start_len=0)
    scored = reply["meta_info"]["input_token_logprobs"]
    assert [entry[1] for entry in scored] == ids and scored[0][0] is None
    with torch.no_grad():
        raw = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    expected = raw.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor([entry[0] for entry in scored[1:]]), expected, atol=2e-3, rtol=0,
                               msg=lambda m: f"{family} prompt logprobs: {m}")


@pytest.mark.parametrize("method", ["int8", "int4", "auto"])
def test_quantized_qwen3_serves_the_in_process_engines_tokens(method: str, rings: Rings,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The server measures its kernel plan at start-up and caches it on disk per host; the in-process engine
    reads that plan, so both run the same kernels on the same quantized weights (auto: the same verdict too).
    The engine takes the plan as stored: the cache re-measures a plan measured on a busier host once the host is
    quiet, and a second measurement on a shared host can choose other kernels. The requests go one at a time on
    both sides: a plan picks a linear's kernel by the step's row count (int8's 64->64 may be float32 for one
    row, q8_0 for 2-15), so a request's tokens depend on what shares its batch."""
    from ringserve.actors.common.model_source import resolve_model
    from ringserve.actors.engine.config import EngineConfig
    from ringserve.actors.engine.scheduling.engine_core import EngineCore
    from ringserve.bus.messages import TokenizedRequest
    from ringserve.kernels.linear_plan import cache as plan_cache

    monkeypatch.setattr(plan_cache, "load_per_core", lambda: plan_cache.BUSY_LOAD * 2)
    server = rings.server(f"qwen3-{method}")
    served_plan = server_info(server.base_url)["quantization"]
    verdicts = ("int8", "none") if method == "auto" else (method,)  # auto: int8 where it measured faster here
    assert served_plan.get("method", "none") in verdicts, served_plan  # {}: unquantized, torch's kernels only
    seqs = prompts(LENGTHS)
    got = [generate(server, ids)["output_ids"] for ids in seqs]
    engine = EngineCore.from_source(resolve_model(str(rings.dirs["qwen3"])), EngineConfig(
        device="cpu", torch_threads=1, max_total_tokens=2048, quantization=method))
    assert engine.stats().quantization == served_plan, "the engine chose other kernels than the server"
    expected = [tokens_of(run_to_completion(engine, [TokenizedRequest(f"q{i}", ids, greedy(
        NEW_TOKENS, ignore_eos=True))])[f"q{i}"]) for i, ids in enumerate(seqs)]
    assert got == expected, served_plan


@pytest.mark.parametrize("case", TP_CASES)
def test_two_tensor_parallel_ranks_give_transformers_tokens(case: str, rings: Rings) -> None:
    """Sharded heads and MLPs; a mixture of experts sliced (`--tp 2`) or placed whole per rank (`--ep 2`);
    DeepSeek's latent attention split by heads over the whole latent."""
    family = case.split("-")[0]
    if family not in CONFIGS:
        pytest.skip(f"{family} is not served yet")
    server = rings.server(case)
    info = server_info(server.base_url)
    assert [(r["tp_size"], r["up"]) for r in info["replicas"]] == [(2, True)], info["replicas"]
    assert_transformers_tokens(family, rings.model(family), server)


def test_an_unsupported_architecture_is_refused_in_one_line(rings: Rings, tmp_path: Path) -> None:
    """A complete directory (weights, tokenizer) whose config.json names an architecture no family serves:
    `ringserve serve` exits before any actor starts: after the progress line saying the model is being read, one
    line naming it and every served architecture."""
    directory = tmp_path / "falcon"
    rings.model("qwen3")
    shutil.copytree(rings.dirs["qwen3"], directory)
    config = json.loads((directory / "config.json").read_text())
    config.update(architectures=["FalconForCausalLM"], model_type="falcon")
    (directory / "config.json").write_text(json.dumps(config))
    done = ringserve_cmd("serve", "--model", str(directory), "--port", "1")
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.splitlines()
    assert len(lines) == 2 and "reading the model" in lines[0], done.stderr
    assert lines[1].startswith(f"ringserve: {directory} "), done.stderr
    assert f"unsupported architecture FalconForCausalLM; served are: {', '.join(SERVED)}" in done.stderr, done.stderr
    assert "started actor" not in done.stdout + done.stderr
