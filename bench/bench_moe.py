"""What a mixture-of-experts layer and latent attention cost here, each against its dense counterpart, in one run.

    .venv/bin/python bench/bench_moe.py [--steps 60] [--quantization none|int8|int4]

1. Decode step time: a Qwen3-MoE model (16 experts, 2 per token, each 512 wide) against a Qwen3 of the same
   active parameters (one MLP 1024 wide, the same attention), one request decoding (then 8), eager engine
   steps, the two engines' steps alternated so both see the same machine load. Target: MoE <= 1.3x dense at
   one row.
2. Weight bytes a one-row decode step reads in each MoE layer (router, the experts it ran, counted by hooks)
   against the bytes of the experts it selected. Target: <= 1.1x.
3. Tensor-parallel placement of the experts, rank 0's share of one MoE block's work (the one all-reduce is the
   same either way and left out): every expert sliced over 2 ranks (`--tp 2`) against whole experts per rank
   (`--tp 2 --ep 2`), at 1 and 32 rows.
4. KV bytes per token of a DeepSeek-V2-shaped model with latent attention against the same model's full K/V.

Prints ratios with the date and CPU; figures hold only as ratios measured side by side in one run.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS, VOCAB = 1024, 16, 4, 64, 4, 4096
EXPERTS, TOP_K, EXPERT_INNER = 16, 2, 512


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def hf_models() -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=4096)
    torch.manual_seed(0)
    moe = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**common, intermediate_size=TOP_K * EXPERT_INNER,
                                                          moe_intermediate_size=EXPERT_INNER, num_experts=EXPERTS,
                                                          num_experts_per_tok=TOP_K, norm_topk_prob=True))
    dense = AutoModelForCausalLM.from_config(Qwen3Config(**common, intermediate_size=TOP_K * EXPERT_INNER))
    return moe.eval(), dense.eval()


def engine(hf: Any, quantization: str) -> Any:
    from ringserve.actors.engine.config import EngineConfig
    from ringserve.actors.engine.models.weights import model_from_hf
    from ringserve.actors.engine.quantization.quantize import apply_quantization
    from ringserve.actors.engine.scheduling.engine_core import EngineCore

    config = EngineConfig(device="cpu", torch_threads=1, max_total_tokens=8192, quantization=quantization,
                          disable_cuda_graph=True)
    built = EngineCore(model_from_hf(hf.config, hf.state_dict()), config)
    apply_quantization(built.runner.model, config)
    return built


def alternating_decode(engines: list[Any], rows: int, steps: int) -> list[float]:
    """Median decode step (ms) of each engine with `rows` requests decoding, steps alternated."""
    from ringserve.bus.messages import SamplingParams, TokenizedRequest

    for i, e in enumerate(engines):
        for r in range(rows):
            prompt = [(7 * r + k) % VOCAB for k in range(16)]
            e.add_request(TokenizedRequest(f"{i}-{r}-{rows}", prompt, SamplingParams(
                max_new_tokens=steps + 4, temperature=0.0, ignore_eos=True)))
        while any(req.output_len == 0 for req in e.live.values()):  # every prompt prefilled
            e.step()
    times: list[list[float]] = [[] for _ in engines]
    for _ in range(steps):
        for i, e in enumerate(engines):
            started = time.perf_counter()
            e.step()
            times[i].append((time.perf_counter() - started) * 1e3)
    for e in engines:
        while e.has_work():
            e.step()
    return [statistics.median(t) for t in times]


def bytes_of(module: Any) -> int:
    """Weight bytes a one-row call of `module` reads: a quantized linear's form its one-row kernel runs, every
    other module's own parameters and buffers."""
    total = 0
    for m in module.modules():
        packed = m.packed_for(1) if hasattr(m, "packed_for") else None
        if packed is not None:
            total += sum(t.numel() * t.element_size() for t in (packed.qweight, packed.scales, packed.mins,
                                                               packed.wsums) if t is not None)
        elif hasattr(m, "packed_for"):  # a quantized linear whose one-row kernel reads its float32 weight
            total += m.weight_f.numel() * m.weight_f.element_size()
        else:
            total += sum(t.numel() * t.element_size() for t in [*m.parameters(recurse=False),
                                                                 *m.buffers(recurse=False)] if t is not None)
    return total


def one_row_weight_reads(moe_engine: Any) -> tuple[int, int]:
    """(bytes the MoE layers read in a one-row decode step, bytes of the experts that step selected)."""
    from ringserve.actors.engine.models.moe import SparseMoE
    from ringserve.bus.messages import SamplingParams, TokenizedRequest

    layers = [layer.mlp for layer in moe_engine.runner.model.decoder_layers() if isinstance(layer.mlp, SparseMoE)]
    moe_engine.add_request(TokenizedRequest("bytes", list(range(3, 19)), SamplingParams(max_new_tokens=3)))
    moe_engine.step()
    read: list[int] = []
    selected: list[int] = []
    def on_route(moe: Any) -> Any:
        def hook(router: Any, args: Any, out: tuple[torch.Tensor, torch.Tensor]) -> None:
            read.append(bytes_of(router))
            selected.extend(bytes_of(moe.experts[e]) for e in out[1][0].tolist())
        return hook

    hooks = [moe.gate.register_forward_hook(on_route(moe)) for moe in layers]
    hooks += [expert.register_forward_hook(lambda m, args, out: read.append(bytes_of(m)))
              for moe in layers for expert in moe.experts]
    moe_engine.step()
    for h in hooks:
        h.remove()
    while moe_engine.has_work():
        moe_engine.step()
    return sum(read), sum(selected)


def placement_times(hf: Any, rows: int, repeats: int) -> tuple[float, float]:
    """Rank 0's median time (ms) for one MoE block over `rows` rows: experts sliced over 2 ranks, then whole
    experts per rank."""
    from ringserve.actors.engine.models.moe import SparseMoE
    from ringserve.actors.engine.models.weights import model_from_hf
    from ringserve.actors.engine.parallel.moe_shard import shard_experts
    from ringserve.actors.engine.parallel.tensor_parallel import TPGroup

    class Rank0(TPGroup):  # the block's own work only: its one all-reduce is the same in both placements
        def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
            return x

    x = torch.randn(rows, HIDDEN)
    blocks = []
    for expert_parallel in (False, True):
        model = model_from_hf(hf.config, hf.state_dict())
        block = next(layer.mlp for layer in model.decoder_layers() if isinstance(layer.mlp, SparseMoE))
        shard_experts(block, Rank0(0, 2, torch.device("cpu")), expert_parallel)
        blocks.append(block)
    times: list[list[float]] = [[], []]
    for _ in range(repeats):
        for i, block in enumerate(blocks):
            started = time.perf_counter()
            block(x)
            times[i].append((time.perf_counter() - started) * 1e3)
    return statistics.median(times[0]), statistics.median(times[1])


def latent_kv_bytes() -> tuple[int, int]:
    """(latent pool bytes per token, full K/V bytes per token) of a DeepSeek-V2-Lite-shaped model, float32."""
    from transformers import DeepseekV2Config

    config = DeepseekV2Config(hidden_size=2048, num_hidden_layers=27, num_attention_heads=16, kv_lora_rank=512,
                              qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, q_lora_rank=None)
    latent = config.num_hidden_layers * (config.kv_lora_rank + config.qk_rope_head_dim) * 4
    full = config.num_hidden_layers * config.num_attention_heads * (
        config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim) * 4
    return latent, full


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--quantization", default="none", choices=("none", "int8", "int4"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{date.today()}  {cpu_name()}  torch {torch.__version__}  threads 1  quantization {args.quantization}")
    moe_hf, dense_hf = hf_models()
    moe, dense = engine(moe_hf, args.quantization), engine(dense_hf, args.quantization)
    for rows in (1, 8):
        t_moe, t_dense = alternating_decode([moe, dense], rows, args.steps)
        target = " (target <= 1.3x)" if rows == 1 else " (8 rows choose up to 16 experts: more weights read)"
        print(f"decode step, {rows} row(s): MoE {t_moe:.2f} ms, dense of the same active parameters "
              f"{t_dense:.2f} ms: {t_moe / t_dense:.2f}x{target}")
    read, selected = one_row_weight_reads(moe)
    print(f"one-row decode, MoE layers: read {read / 1e6:.2f} MB, the selected experts hold {selected / 1e6:.2f} MB: "
          f"{read / selected:.3f}x (target <= 1.1x)")
    for rows in (1, 32):
        sliced, whole = placement_times(moe_hf, rows, max(20, args.steps // 2))
        print(f"MoE block on rank 0 of 2, {rows} row(s): experts sliced {sliced:.2f} ms, whole experts (--ep) "
              f"{whole:.2f} ms: ep/sliced {whole / sliced:.2f}x")
    latent, full = latent_kv_bytes()
    print(f"KV bytes per token, DeepSeek-V2-Lite shape (float32): latent {latent} against full K/V {full}: "
          f"{full / latent:.1f}x smaller")


if __name__ == "__main__":
    main()
