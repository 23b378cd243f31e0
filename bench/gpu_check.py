"""Decode speed on one GPU: ringserve's engine with each attention backend, CUDA graphs off and on (with graphs,
the overlap loop off and on), next to transformers `generate` on the same GPU and the HBM roofline.
`bench/gpu_check.sh` runs it (with the GPU tests first); it prints a table and writes JSON.

Models have random weights in a real shape (speed does not depend on the values): SmolLM2-135M and a
1B-parameter Llama (Llama-3.2-1B's shape, plain RoPE). For each batch size `bs`, `bs` requests with
`--prompt-len`-token prompts are prefilled, then `--steps` decode steps are timed after `--warmup` more
(every request has `min_new_tokens` set so none stops early). Decode tok/s = bs * steps / seconds, engine
scheduling and host work included.

Roofline at batch `bs`: one decode step must read every weight once (embedding rows aside; a tied LM head
counts once) plus every request's cached K/V, so step time >= bytes / bandwidth, with the bandwidth measured
here as a device-to-device copy (bytes read + written / time). Roofline tok/s = bs / that time.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

MODELS: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True),
    "llama-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                     rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {list(MODELS)}")
    p.add_argument("--backends", default="triton,flashinfer,torch",
                   help="attention backends (those not installed are skipped); torch runs eager only")
    p.add_argument("--batch-sizes", default="1,8,32,128")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--no-hf", action="store_true", help="skip the transformers generate baseline")
    p.add_argument("--out", default="gpu_check.json", help="JSON results file")
    p.add_argument("--pytest-log", default="", help="a pytest log whose summary line goes into the JSON")
    p.add_argument("--time-budget", type=float, default=330.0, help="seconds; later runs are skipped past it")
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.backends = [b for b in args.backends.split(",") if b]
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        p.error(f"unknown models {unknown}; choose from {list(MODELS)}")
    return args


def copy_bandwidth(torch: Any, gib: float = 2.0, repeats: int = 10) -> float:
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
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * element_size


def roofline_tok_s(bs: int, weights: int, kv_per_token: int, mean_kv_len: float, bandwidth: float) -> float:
    step_bytes = weights + bs * mean_kv_len * kv_per_token
    return bs / (step_bytes / bandwidth)


def bench_engine(model: Any, backend: str, graphs: bool, overlap: bool, args: argparse.Namespace,
                 vocab: int) -> dict[int, float]:
    """Decode tok/s of the engine at each batch size (one engine, graphs captured once up to the largest)."""
    import torch

    from actors.engine.config import EngineConfig
    from actors.engine.engine import Engine
    from bus.messages import TokenizedRequest, SamplingParams

    max_bs = max(args.batch_sizes)
    new_tokens = args.warmup + args.steps + 2
    config = EngineConfig(device="cuda", dtype=args.dtype, attention_backend=backend, disable_cuda_graph=not graphs,
                          cuda_graph_max_bs=max_bs, max_running_requests=max_bs,
                          max_total_tokens=max_bs * (args.prompt_len + new_tokens) + 64,
                          max_prefill_tokens=max(8192, max_bs * args.prompt_len), chunked_prefill_size=0,
                          disable_radix_cache=True, overlap_schedule="on" if overlap else "off")
    engine = Engine(model, config)
    gen = torch.Generator().manual_seed(0)
    result: dict[int, float] = {}
    for bs in args.batch_sizes:
        params = SamplingParams(max_new_tokens=new_tokens, min_new_tokens=new_tokens, temperature=0.0)
        for i in range(bs):
            ids = torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist()
            assert engine.add_request(TokenizedRequest(f"b{bs}-{i}", ids, params)) is None
        while engine.stats().num_waiting_reqs:  # prefill (first tokens)
            engine.step()
        for _ in range(args.warmup):
            engine.step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()  # each step waits for its tokens on the host, as serving does
        torch.cuda.synchronize()
        result[bs] = bs * args.steps / (time.perf_counter() - start)
        engine.abort_all()
    del engine
    torch.cuda.empty_cache()
    return result


def bench_hf(hf: Any, args: argparse.Namespace, vocab: int) -> dict[int, float]:
    """transformers `generate` decode tok/s: (time for 1 + steps tokens - time for 1 token) per batch size."""
    import torch

    gen = torch.Generator().manual_seed(0)
    result: dict[int, float] = {}

    def timed(ids: Any, n: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                    pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    for bs in args.batch_sizes:
        ids = torch.randint(3, vocab, (bs, args.prompt_len), generator=gen).cuda()
        timed(ids, 2)  # warm-up
        decode = timed(ids, 1 + args.steps) - timed(ids, 1)
        result[bs] = bs * args.steps / decode
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing to measure")
        return 2
    from transformers import LlamaConfig, LlamaForCausalLM

    from actors.engine.weights import model_from_hf
    from kernels.attention import backend_names

    t0 = time.perf_counter()
    dtype = getattr(torch, args.dtype)
    bandwidth = copy_bandwidth(torch)
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "dtype": args.dtype, "copy_bandwidth_GBps": bandwidth / 1e9, "prompt_len": args.prompt_len,
        "steps": args.steps, "backends_installed": list(backend_names()), "models": {}, "skipped": [],
    }
    rows: list[tuple[str, ...]] = []
    for name in args.models:
        cfg = LlamaConfig(**MODELS[name], initializer_range=0.02)
        torch.manual_seed(0)
        with torch.device("cuda"):
            hf = LlamaForCausalLM(cfg).to(dtype).eval()
        state = hf.state_dict()
        model = model_from_hf(cfg, state, "cuda")
        weights = weight_bytes(model)
        kv_tok = kv_bytes_per_token(cfg, torch.finfo(dtype).bits // 8)
        mean_kv = args.prompt_len + args.warmup + args.steps / 2
        entry: dict[str, Any] = {"params": sum(p.numel() for p in hf.parameters()), "weight_bytes": weights,
                                 "roofline_tok_s": {}, "engine": {}, "hf_generate": {}}
        for bs in args.batch_sizes:
            entry["roofline_tok_s"][bs] = roofline_tok_s(bs, weights, kv_tok, mean_kv, bandwidth)
        if not args.no_hf:
            entry["hf_generate"] = bench_hf(hf, args, cfg.vocab_size)
        del hf, model
        for backend in args.backends:
            if backend not in backend_names():
                report["skipped"].append(f"{name}/{backend}: not installed")
                continue
            # eager, then graphs without and with the overlap loop (the cuda default)
            variants = [(False, True)] if backend == "torch" else [(False, True), (True, False), (True, True)]
            for graphs, overlap in variants:
                key = f"{backend}{'+graphs' if graphs else ''}{'+overlap' if overlap else ''}"
                if time.perf_counter() - t0 > args.time_budget:
                    report["skipped"].append(f"{name}/{key}: time budget spent")
                    continue
                try:  # a fresh model each time: the triton backend swaps in its own RMSNorm modules
                    model = model_from_hf(cfg, state, "cuda")
                    entry["engine"][key] = bench_engine(model, backend, graphs, overlap, args, cfg.vocab_size)
                    del model
                except Exception as exc:  # one backend failing must not hide the others' figures
                    report["skipped"].append(f"{name}/{key}: {exc!r}"[:500])
        report["models"][name] = entry
        del state
        torch.cuda.empty_cache()
        for bs in args.batch_sizes:
            roof = entry["roofline_tok_s"][bs]
            hf_tok = entry["hf_generate"].get(bs)
            for key, speeds in entry["engine"].items():
                tok = speeds[bs]
                rows.append((name, key, str(bs), f"{tok:,.0f}", f"{tok / hf_tok:.2f}x" if hf_tok else "-",
                             f"{100 * tok / roof:.0f}%"))
            rows.append((name, "transformers", str(bs), f"{hf_tok:,.0f}" if hf_tok else "-", "1.00x", "-"))
            rows.append((name, "roofline", str(bs), f"{roof:,.0f}", "-", "100%"))
    if args.pytest_log:
        try:
            with open(args.pytest_log) as log:
                report["pytest"] = [ln.strip() for ln in log if ln.strip().endswith("s") and (
                    " passed" in ln or " failed" in ln or " skipped" in ln or " error" in ln)]
        except OSError as exc:
            report["pytest"] = f"unreadable: {exc}"
    report["seconds"] = time.perf_counter() - t0
    header = ("model", "engine", "bs", "decode tok/s", "vs HF", "of roofline")
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    print(f"{report['gpu']}  {args.dtype}  copy bandwidth {bandwidth / 1e9:,.0f} GB/s  {report['date']}")
    for r in [header] + rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    for s in report["skipped"]:
        print("skipped:", s)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out} ({report['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
