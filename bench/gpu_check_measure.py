"""The measurements of the GPU check (`bench/gpu_check.py` runs them in one child process per backend): the
device and its copy bandwidth, greedy equality of the engine with transformers on SmolLM2, the engine's decode
tok/s for one (model, backend, graphs, overlap, batch size), and transformers `generate`'s for one (model,
batch size). Each returns the fields of one result row.

Speed models have random weights in a real shape (speed does not depend on the values). For batch size `bs`,
`bs` requests with `--prompt-len`-token prompts are prefilled, then `--steps` decode steps are timed after
`--warmup` more (every request has `min_new_tokens` set so none stops early). Decode tok/s = bs * steps /
seconds, engine scheduling and host work included. Each speed piece builds its own engine (graphs captured up
to `bs` only), so a piece's seconds are its whole cost.

Roofline at batch `bs`: one decode step must read every weight once (a tied LM head once) plus every request's
cached K/V, so step time >= bytes / bandwidth, with the bandwidth measured as a device-to-device copy (bytes
read + written / time). Roofline tok/s = bs / that time.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch

MODELS: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True),
    "llama-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                     rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True),
}
EQUALITY_PROMPT_LENS = (1, 7, 23, 60)
EQUALITY_NEW_TOKENS = 24
EQUALITY_TOL = {"float32": 1e-3, "bfloat16": 0.5}  # logit gap under which the other token of a tie is fine


def copy_bandwidth(gib: float = 2.0, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + written)."""
    n = int(gib * 2**30) // 4
    src = torch.empty(n, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1000 / repeats
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n * 4 / seconds


def weight_bytes(model: Any) -> int:
    """Bytes of every distinct parameter tensor (a tied LM head once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def kv_bytes_per_token(cfg: Any, element_size: int) -> int:
    """K and V bytes one token adds to the cache, all layers."""
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * element_size


def roofline_tok_s(bs: int, weights: int, kv_per_token: int, mean_kv_len: float, bandwidth: float) -> float:
    """Decode tok/s if a step only had to read the weights and the batch's KV at `bandwidth`."""
    step_bytes = weights + bs * mean_kv_len * kv_per_token
    return bs / (step_bytes / bandwidth)


def jit_in_background() -> bool:
    """Whether the FlashInfer warm-up (`$GPU_CHECK_WARMUP_PID`) still compiles: such figures share the CPU."""
    pid = os.environ.get("GPU_CHECK_WARMUP_PID", "")
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (ValueError, OSError, IndexError):
        return False


class Bench:
    """The measurements of one process; keeps one random-weight model (the latest asked for) on the GPU."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dtype = getattr(torch, args.dtype)
        self.bandwidth: float | None = None
        self._model: tuple[str, Any, Any, dict[str, Any]] | None = None  # name, config, HF model, state

    def meta(self) -> dict[str, Any]:
        """The device, the versions and the copy bandwidth."""
        from ringserve.kernels.attention import backend_names

        versions: dict[str, str] = {}
        for name in ("triton", "flashinfer", "transformers"):
            try:
                versions[name] = __import__(name).__version__
            except Exception as exc:  # a missing or broken package is itself a finding
                versions[name] = f"unavailable: {type(exc).__name__}"
        self.bandwidth = copy_bandwidth()
        return {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                "cuda": torch.version.cuda, **versions, "dtype": self.args.dtype,
                "copy_bandwidth_GBps": self.bandwidth / 1e9, "backends_installed": list(backend_names())}

    def model(self, name: str) -> tuple[Any, Any, dict[str, Any]]:
        """(config, HF model on the GPU, its state dict) for `name`, random weights, built once."""
        if self._model is None or self._model[0] != name:
            from transformers import LlamaConfig, LlamaForCausalLM

            self._model = None
            torch.cuda.empty_cache()
            cfg = LlamaConfig(**MODELS[name], initializer_range=0.02)
            torch.manual_seed(0)
            with torch.device("cuda"):
                hf = LlamaForCausalLM(cfg).to(self.dtype).eval()
            self._model = (name, cfg, hf, hf.state_dict())
        return self._model[1], self._model[2], self._model[3]

    def run(self, key: dict[str, Any]) -> dict[str, Any]:
        """The row fields of the piece named by `key`."""
        kind = key["kind"]
        if kind == "speed":
            return self.speed(key["model"], key["backend"], key["graphs"], key["overlap"], key["bs"])
        if kind == "hf":
            return self.hf_speed(key["model"], key["bs"])
        if kind == "equality":
            return self.equality(key["backend"])
        raise ValueError(f"unknown piece kind {kind!r}")

    @torch.no_grad()
    def speed(self, name: str, backend: str, graphs: bool, overlap: bool, bs: int) -> dict[str, Any]:
        """The engine's decode tok/s at batch `bs`, next to the roofline."""
        from ringserve.actors.engine.config import EngineConfig
        from ringserve.actors.engine.execution_plan import resolve_execution
        from ringserve.actors.engine.scheduling.engine_core import EngineCore
        from ringserve.actors.engine.models.weights import model_from_hf
        from ringserve.bus.messages import SamplingParams, TokenizedRequest

        a = self.args
        start = time.perf_counter()
        cfg, _, state = self.model(name)
        new_tokens = a.warmup + a.steps + 2
        config = EngineConfig(device="cuda", dtype=a.dtype, attention_backend=backend,
                              disable_cuda_graph=not graphs, cuda_graph_max_bs=bs, max_running_requests=bs,
                              max_total_tokens=bs * (a.prompt_len + new_tokens) + 64,
                              max_prefill_tokens=max(8192, bs * a.prompt_len), chunked_prefill_size=0,
                              disable_radix_cache=True, overlap_schedule="on" if overlap else "off")
        plan = resolve_execution(config)
        model = model_from_hf(cfg, state, "cuda", plan)  # fresh each time: built with the backend's norm kernels
        engine = EngineCore(model, config, execution=plan)
        try:
            setup = time.perf_counter() - start
            gen = torch.Generator().manual_seed(bs)
            params = SamplingParams(max_new_tokens=new_tokens, min_new_tokens=new_tokens, temperature=0.0)
            for i in range(bs):
                ids = torch.randint(3, cfg.vocab_size, (a.prompt_len,), generator=gen).tolist()
                error = engine.add_request(TokenizedRequest(f"b{bs}-{i}", ids, params))
                if error is not None:
                    raise RuntimeError(f"add_request refused: {error}")
            while engine.stats().num_waiting_reqs:  # prefill (first tokens)
                engine.step()
            for _ in range(a.warmup):
                engine.step()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(a.steps):
                engine.step()  # each step waits for its tokens on the host, as serving does
            torch.cuda.synchronize()
            tok_s = bs * a.steps / (time.perf_counter() - t0)
            engine.abort_all()
        finally:
            del engine
        if self.bandwidth is None:
            self.bandwidth = copy_bandwidth()
        kv_tok = kv_bytes_per_token(cfg, torch.finfo(self.dtype).bits // 8)
        mean_kv = a.prompt_len + a.warmup + a.steps / 2
        roof = roofline_tok_s(bs, weight_bytes(model), kv_tok, mean_kv, self.bandwidth)
        del model
        torch.cuda.empty_cache()
        return {"tok_s": tok_s, "roofline_tok_s": roof, "setup_seconds": round(setup, 3),
                "jit_in_background": jit_in_background()}

    @torch.no_grad()
    def hf_speed(self, name: str, bs: int) -> dict[str, Any]:
        """transformers `generate` decode tok/s: (time for 1 + steps tokens - time for 1 token)."""
        a = self.args
        cfg, hf, _ = self.model(name)
        ids = torch.randint(3, cfg.vocab_size, (bs, a.prompt_len), generator=torch.Generator().manual_seed(bs))
        ids = ids.cuda()

        def timed(n: int) -> float:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                        min_new_tokens=n, pad_token_id=0)
            torch.cuda.synchronize()
            return time.perf_counter() - t0

        timed(2)  # warm-up
        decode = timed(1 + a.steps) - timed(1)
        return {"tok_s": bs * a.steps / decode, "jit_in_background": jit_in_background()}

    @torch.no_grad()
    def equality(self, backend: str) -> dict[str, Any]:
        """Greedy tokens of the engine (graphs and the overlap loop on, as served) against transformers' in
        float32 on SmolLM2: float32 for torch and triton, bfloat16 for FlashInfer (no float32 kernels)."""
        from ringserve.bus.messages import TokenizedRequest
        from tests.engine_helpers import greedy, load_hf_model, run_to_completion, tiny_hf_llama, tokens_of
        from tests.gpu.helpers import assert_greedy_close, gpu_engine, hf_greedy_gpu, hf_on_gpu, smollm2_source

        source = smollm2_source()
        if source is not None:
            hf_cpu, weights = load_hf_model(source), "real weights"
        else:
            hf_cpu, weights = tiny_hf_llama(**MODELS["smollm2-135m"]), "random weights in its shape"
        dtype_name = "bfloat16" if backend == "flashinfer" else "float32"
        ref = hf_on_gpu(hf_cpu, torch.float32)
        eos = hf_cpu.config.eos_token_id if isinstance(hf_cpu.config.eos_token_id, int) else None
        gen = torch.Generator().manual_seed(11)
        prompts = [torch.randint(3, hf_cpu.config.vocab_size, (n,), generator=gen).tolist()
                   for n in EQUALITY_PROMPT_LENS]
        expected = [hf_greedy_gpu(ref, p, EQUALITY_NEW_TOKENS, eos) for p in prompts]
        engine = gpu_engine(hf_cpu, backend, getattr(torch, dtype_name), graphs=True)
        stop = [eos] if eos is not None else []
        reqs = [TokenizedRequest(f"eq{i}", p, greedy(EQUALITY_NEW_TOKENS, stop_token_ids=stop))
                for i, p in enumerate(prompts)]
        rows = run_to_completion(engine, reqs)
        got = [tokens_of(rows[f"eq{i}"]) for i in range(len(prompts))]
        del engine
        equal = sum(e == g for e, g in zip(expected, got))
        near_tie, mismatch = 0, ""
        for p, e, g in zip(prompts, expected, got):
            if e == g:
                continue
            try:
                assert_greedy_close(ref, p, e, g, tol=EQUALITY_TOL[dtype_name])
                near_tie += 1
            except AssertionError as exc:
                mismatch = mismatch or str(exc)[:600]
        del ref
        torch.cuda.empty_cache()
        return {"status": "mismatch" if mismatch else "ok", "dtype": dtype_name, "weights": weights,
                "prompts": len(prompts), "equal": equal, "near_tie": near_tie,
                **({"error": mismatch} if mismatch else {})}
