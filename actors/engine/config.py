"""Engine configuration: one dataclass that is also the single definition of the engine's CLI flags.

`EngineConfig.add_arguments(parser)` generates `--flag`s from the fields (help, choices and defaults live in
each field's metadata), `from_args` reads them back, and `to_argv` turns a config into the flags that the
launcher passes on to a scheduler process, so a new setting is added in exactly one place.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from dataclasses import dataclass, field
from typing import Any

from ringserve.actors.common import flag_fields
from ringserve.actors.common.flag_fields import flag
from ringserve.actors.common.help_format import ENGINE, LORA, MODEL, SCALE_OUT, SPECULATIVE
from ringserve.actors.common.memory_limits import CGROUP_ROOT, MemoryBudget, available_memory
from ringserve.bus.params import POOLINGS
from ringserve.kernels.attention import backend_names
from ringserve.observability.logging import log_event

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's and SGLang's other names of the same dtypes
LORA_JSON_KEYS = ("name", "path")  # the keys a --lora-modules JSON object (vLLM's form) must have
LORA_JSON_OPTIONAL = ("base_model_name",)  # and may have: the launcher checks it names the served model
QUANTIZATION_CHOICES = ("none", "int8", "int4", "gguf", "auto")
FLOAT_KERNEL_CHOICES = ("auto", "float32")
SCHEDULE_POLICIES = ("fcfs", "lpm")
ROLES = ("prefill", "decode", "both")  # --replica-role: what a scheduler replica takes (actors/scheduler/kv_share.py)
OVERLAP_CHOICES = ("auto", "on", "off")
SPECULATIVE_ALGORITHMS = ("none", "ngram", "draft")
CPU_MEM_FRACTION = 0.1  # of total host memory (or the cgroup limit), when the KV pool lives on the CPU
GPU_MEM_FRACTION = 0.85  # of free GPU memory after the weights are loaded
# An automatic pool size is rounded down to a multiple of this: the pool's shape is part of a compiled decode
# graph, so a size that moved with the free memory at every start missed Inductor's on-disk cache every time.
POOL_ROUNDING = 4096
# A CPU pool never takes more than this share of the memory available at start (it is halved until it fits).
POOL_SAFE_SHARE = 0.5
# What a graceful stop may spend saving the cached prefix blocks to --kv-tier-dir: the launcher kills an actor 10 s
# after it starts stopping the ring (actors/launcher/supervisor.py), the runtime waits 10 s per stop hook.
KV_TIER_STOP_SAVE_SECONDS = 5.0


def _flag(help: str, group: str = ENGINE, **argparse_kwargs: Any) -> dict[str, Any]:
    """A field's flag (actors/common/flag_fields.py), in `ringserve serve --help`'s engine group unless `group`
    says another (`nargs="+"`: a tuple field taking several values, also over repeated flags; `type`: a converter
    applied before `choices` are checked)."""
    return flag(help, group=group, **argparse_kwargs)


def served_context_length(model_context: int, context_length: int | None) -> int:
    """The context served for a model whose own is `model_context`: `--context-length` when set (ValueError when
    it is longer than the model's, whose positions past it were never trained), else the model's. The scheduler
    and the tokenizer both bound requests by it."""
    if context_length is None:
        return model_context
    if context_length > model_context:
        raise ValueError(f"--context-length {context_length} is longer than the model's own context length "
                         f"{model_context}: pass at most {model_context}, or leave it out")
    return context_length


def dtype_name(value: str) -> str:
    """`--dtype` as we name it: vLLM's and SGLang's `half` and `float` are float16 and float32."""
    return DTYPE_ALIASES.get(value, value)


@dataclass
class EngineConfig:
    """Placement, capacity and scheduling of one engine (one scheduler rank)."""

    device: str = field(default="auto", metadata=_flag(
        "device for weights and KV cache: auto (cuda when available, else cpu), cpu, cuda or cuda:N"))
    dtype: str = field(default="auto", metadata=_flag(
        "weight and KV dtype: auto (float32 on cpu, bfloat16 on cuda); half and float are float16 and float32",
        choices=DTYPE_CHOICES, type=dtype_name, group=MODEL))
    attention_backend: str = field(default="auto", metadata=_flag(
        "attention kernels over the paged KV cache: auto (triton on cuda when installed, else torch)",
        choices=("auto",) + backend_names()))
    quantization: str = field(default="none", metadata=_flag(
        "weight quantization (CPU): none (float32 weights, each step size through the float32 kernel measured "
        "fastest here: torch's, our GEMV at 1-3 rows, or oneDNN's), int8 (int8 weights in groups of 32), int4 "
        "(4-bit weights in groups of 32, llama.cpp's Q4_1), gguf (a .gguf model's own blocks, as llama.cpp runs them, "
        "never requantized: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants Q4_K, Q5_K, Q6_K), auto (int8 when a start-up micro-benchmark finds it faster on this CPU); "
        "each step size runs the kernel measured fastest here, never one slower than float32",
        choices=QUANTIZATION_CHOICES, group=MODEL))
    float_kernels: str = field(default="auto", metadata=_flag(
        "what an unquantized CPU model's float32 linears may run: auto (each step size the kernel measured "
        "fastest here, which for a bfloat16 checkpoint may be bfloat16: the checkpoint's own weights, activations "
        "rounded to bfloat16, as transformers computes in bfloat16), float32 (float32 kernels only)",
        choices=FLOAT_KERNEL_CHOICES, group=MODEL))
    enable_deterministic_inference: bool = field(default=False, metadata=_flag(
        "make a row's result independent of the rows beside it (SGLang's name; CPU): greedy output is then the same "
        "alone, in any batch and under speculation. Every linear runs one kernel whose rows' bits do not depend on "
        "the row count (quantized: its group kernel; float32: oneDNN's, a one-row call run as two), every query "
        "row attends through the paged decode kernel, and no fused decode layer or compiled decode graph runs "
        "(docs/engine.md, \"Deterministic inference\": what it costs)"))
    context_length: int | None = field(default=None, metadata=_flag(
        "the longest sequence served, prompt and output together: at most the model's own context length (its "
        "config's max_position_embeddings, or further with dynamic rotary scaling), which is the default; a "
        "shorter one bounds every request and the KV cache a request may hold", type=int, group=MODEL,
        aliases=("--max-model-len",), metavar="TOKENS"))
    max_total_tokens: int = field(default=0, metadata=_flag(
        "KV cache size in tokens (0 = sized from memory, see --mem-fraction-static)"))
    mem_fraction_static: float = field(default=0.0, metadata=_flag(
        f"fraction of memory for the KV cache when --max-total-tokens is 0 (0 = {CPU_MEM_FRACTION} of total "
        f"RAM or the cgroup limit on cpu, in power-of-two steps and at most half of what is available; "
        f"{GPU_MEM_FRACTION} of free GPU memory on cuda)"))
    max_prefill_tokens: int = field(default=8192, metadata=_flag(
        "prompt tokens prefilled per step at most (without chunking, one longer prompt still runs alone)"))
    chunked_prefill_size: int = field(default=512, metadata=_flag(
        "longest prefill chunk of one request per step; longer prompts prefill in chunks between decode "
        "steps (0 or -1 = off)"))
    max_running_requests: int = field(default=256, metadata=_flag("requests decoding at once at most"))
    disable_radix_cache: bool = field(default=False, metadata=_flag(
        "do not keep finished requests' KV for reuse by later requests with the same prefix"))
    embedding_pooling: str = field(default="last", metadata=_flag(
        "how /v1/embeddings pools a prompt's final-norm hidden states unless the request says: last (the last "
        "token's) or mean (over every prompt token)", choices=POOLINGS))
    kv_tier_bytes: int = field(default=0, metadata=_flag(
        "a second KV tier of this many bytes: prefix blocks (64 tokens) the pool evicts are kept there, and a "
        "later prompt that continues its cached prefix with them loads them instead of computing them; in host "
        "memory, or in files under --kv-tier-dir (0 = off)"))
    kv_tier_dir: str = field(default="", metadata=_flag(
        "with --kv-tier-bytes: keep the tier's blocks as files in this directory (a restarted replica loads "
        "what an earlier one kept, for the same weights); default: host memory"))
    kv_tier_write_through: bool = field(default=False, metadata=_flag(
        "with --kv-tier-bytes: save each prefix block to the tier as soon as it is cached, not only when the pool "
        "evicts it, so a crash loses nothing already cached (a copy and, with --kv-tier-dir, a file write per "
        "block on the step path); without it, a graceful stop saves the cached blocks, most recently used first, "
        f"within --kv-tier-bytes and {KV_TIER_STOP_SAVE_SECONDS:g} s"))
    kv_share: bool = field(default=False, metadata=_flag(
        "with --kv-tier-bytes and --dp: a replica lacking a prompt's prefix that another replica holds fetches its "
        "blocks over NATS (and serves its own to the others) instead of computing them", group=SCALE_OUT))
    kv_fetch_timeout: float = field(default=5.0, metadata=_flag(
        "with --kv-share: seconds a fetch of another replica's blocks may take; past it, what came is loaded and "
        "the rest computed", group=SCALE_OUT))
    replica_role: str = field(default="both", metadata=_flag(
        "with --dp and --kv-share: prefill, decode or both, for every replica or per replica as a comma list "
        "(replica r takes entry r, the last entry the rest): routing sends requests to decode (and both) "
        "replicas, which have a prefill replica compute a prompt's whole blocks and fetch them", group=SCALE_OUT))
    prefill_timeout: float = field(default=60.0, metadata=_flag(
        "with --replica-role: seconds a decode replica waits for a prefill replica's blocks before computing them "
        "itself", group=SCALE_OUT))
    schedule_policy: str = field(default="fcfs", metadata=_flag(
        "order of admission: fcfs (arrival) or lpm (longest cached prefix first)", choices=SCHEDULE_POLICIES))
    torch_threads: int = field(default=0, metadata=_flag(
        "threads for the scheduler's torch compute (0 on a CPU = all cores or all but one per step size, "
        "whichever the scheduler measures faster as it serves)"))
    cuda_graph_max_bs: int = field(default=160, metadata=_flag(
        "largest decode batch run from a graph (sizes 1, 2, 4, 8, then steps of 8; a batch pads to the next): "
        "CUDA graphs captured at start on a GPU, torch.compile graphs on a CPU, each compiled in the background "
        "when a batch first needs its size while eager steps serve; larger batches, prefill and mixed batches "
        "run eagerly"))
    disable_cuda_graph: bool = field(default=False, metadata=_flag(
        "run every decode step eagerly: no CUDA graphs on a GPU, no compiled decode graphs on a CPU"))
    overlap_schedule: str = field(default="auto", metadata=_flag(
        "plan and launch decode step N+1 before applying step N's tokens, so the host's work hides behind the "
        "device's: auto (on cuda; on a CPU the forward blocks and nothing would overlap), on, off",
        choices=OVERLAP_CHOICES))
    stream_interval: int = field(default=1, metadata=_flag(
        "tokens per message of a request's output through the ring (its first and last rows go at once): 1 "
        "sends every token as it is made; k > 1 sends a stream's tokens k at a time, saving the ring's work "
        "per message, which on a small CPU host takes the cores a decode step needs"))
    grammar_compile_timeout: float = field(default=30.0, metadata=_flag(
        "CPU seconds an output constraint (json_schema, regex, ebnf) may take to compile before its request fails "
        "(on a busy host its wall time may reach 10 times that); compiling never delays other requests"))
    grammar_warm_up: bool = field(default=True, metadata=_flag(
        "make the grammar compilers and start one compile worker each in the scheduler and the tokenizer as they "
        "start (the worker before the weights load), before they report ready, so the first constrained request "
        "(a JSON schema, a tool call) does not wait for them; --no-grammar-warm-up leaves them to that request "
        "(each worker holds about 200 MB)"))
    disable_jump_forward: bool = field(default=False, metadata=_flag(
        "decode the tokens an output constraint forces one step each, instead of appending them at once"))
    speculative_algorithm: str = field(default="none", metadata=_flag(
        "speculative decoding: ngram drafts each greedy request's next tokens from where its last tokens occurred "
        "before (its own prompt and output, then earlier requests) and verifies them in one forward, keeping the "
        "output token for token; draft takes the drafts from a smaller model with the same tokenizer "
        "(--speculative-draft-model-path); none decodes one token per step; any case (SGLang's NGRAM)",
        choices=SPECULATIVE_ALGORITHMS, type=str.lower, group=SPECULATIVE))
    speculative_draft_model_path: str = field(default="", metadata=_flag(
        "with --speculative-algorithm draft: the draft model (a .gguf, a directory or a hub id, as --model), run "
        "beside the served one in the scheduler's process", group=SPECULATIVE))
    speculative_num_draft_tokens: int = field(default=3, metadata=_flag(
        "with --speculative-algorithm: draft tokens per verify step at most (each request adapts its own "
        "length to what it gets accepted); a request verifying k drafts is k + 1 decode rows of one step",
        group=SPECULATIVE))

    enable_lora: bool = field(default=False, metadata=_flag(
        "serve LoRA adapters (on by itself with --lora-modules or --lora-dir): loaded at start or at run time "
        "(/v1/load_lora_adapter), chosen per request by OpenAI's model field or lora_name", group=LORA))
    lora_modules: tuple[str, ...] = field(default=(), metadata=_flag(
        "LoRA adapters (PEFT directories) to load at start: name=path arguments (several after one flag, as "
        "vLLM takes them, or within one argument separated by commas), or vLLM's JSON objects, one an argument: "
        "'{\"name\": \"a1\", \"path\": \"/x\", \"base_model_name\": \"m\"}' (base_model_name, if given, must be the "
        "served model's name or --model; other keys are refused)",
        nargs="+", metavar="NAME=PATH|JSON", group=LORA))
    max_loras_per_batch: int = field(default=8, metadata=_flag(
        "distinct LoRA adapters in one step at most (requests of other adapters wait)", group=LORA))
    max_loaded_loras: int = field(default=0, metadata=_flag(
        "LoRA adapters kept loaded in host memory at most, least recently used first out and read again from "
        "disk when next used (0 = all registered)", group=LORA))
    max_lora_rank: int = field(default=64, metadata=_flag(
        "highest LoRA rank served (every slot holds this rank; smaller ranks are zero-padded)", group=LORA))
    lora_dir: str = field(default="", metadata=_flag(
        "with LoRA: /v1/load_lora_adapter loads only adapters under this directory (empty = any path)", group=LORA))

    def __post_init__(self) -> None:
        self.dtype = dtype_name(self.dtype)
        if isinstance(self.lora_modules, str):  # one argument, as Python callers and the comma form give it
            self.lora_modules = (self.lora_modules,) if self.lora_modules else ()
        self.lora_modules = tuple(self.lora_modules)
        self.lora_module_map()  # a malformed entry is a start-up error
        for name in ("max_prefill_tokens", "max_running_requests", "cuda_graph_max_bs", "stream_interval",
                     "speculative_num_draft_tokens", "max_loras_per_batch", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.context_length is not None and self.context_length < 1:
            raise ValueError(f"--context-length must be at least 1, got {self.context_length}")
        for name in ("max_total_tokens", "torch_threads", "kv_tier_bytes", "max_loaded_loras"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if (self.speculative_algorithm == "draft") != bool(self.speculative_draft_model_path):
            raise ValueError("--speculative-algorithm draft and --speculative-draft-model-path go together")
        if self.kv_tier_dir and not self.kv_tier_bytes:
            raise ValueError("--kv-tier-dir needs --kv-tier-bytes (the tier's bound)")
        if self.kv_tier_write_through and not self.kv_tier_bytes:
            raise ValueError("--kv-tier-write-through needs --kv-tier-bytes (the tier it writes to)")
        roles = self.replica_role.split(",")
        if any(r not in ROLES for r in roles):
            raise ValueError(f"--replica-role takes {', '.join(ROLES)} (or a comma list of them), got {self.replica_role!r}")
        if set(roles) != {"both"} and not self.kv_share:
            raise ValueError("--replica-role prefill/decode hands KV between replicas: it needs --kv-share")
        if not self.prefill_timeout > 0:
            raise ValueError(f"prefill_timeout must be > 0, got {self.prefill_timeout}")
        if self.kv_share and not self.kv_tier_bytes:
            raise ValueError("--kv-share fetches blocks into the KV tier: it needs --kv-tier-bytes")
        if not self.kv_fetch_timeout > 0:
            raise ValueError(f"kv_fetch_timeout must be > 0, got {self.kv_fetch_timeout}")
        if self.kv_tier_bytes and self.disable_radix_cache:
            raise ValueError("--kv-tier-bytes keeps the prefix cache's evicted blocks: not with --disable-radix-cache")
        if not self.grammar_compile_timeout > 0:
            raise ValueError(f"grammar_compile_timeout must be > 0, got {self.grammar_compile_timeout}")
        if not 0 <= self.mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static must be in [0, 1), got {self.mem_fraction_static}")
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(f"{f.name} must be one of {list(choices)}, got {getattr(self, f.name)!r}")

    def role_of(self, replica: int) -> str:
        """Replica `replica`'s `--replica-role`: its entry of the list, the last one past its end."""
        roles = self.replica_role.split(",")
        return roles[min(replica, len(roles) - 1)]

    def lora_enabled(self) -> bool:
        """Whether the engine serves LoRA adapters."""
        return self.enable_lora or bool(self.lora_modules) or bool(self.lora_dir)

    def lora_module_map(self) -> dict[str, str]:
        """`--lora-modules` as name -> path. Each argument is vLLM's JSON object (`{"name", "path"}`) or name=path
        entries separated by commas or spaces; ValueError for an entry that is neither, a JSON key we do not
        honour, or a name given twice."""
        out: dict[str, str] = {}
        for argument in self.lora_modules:
            for name, path, _ in _lora_entries(argument):
                if name in out:
                    raise ValueError(f"--lora-modules names adapter {name!r} twice")
                out[name] = path
        return out

    def lora_base_models(self) -> dict[str, str]:
        """The `base_model_name` each `--lora-modules` JSON object gives (adapter name -> base), for the launcher
        to check against the served model: an adapter always applies to the one model served."""
        return {name: base for argument in self.lora_modules for name, _, base in _lora_entries(argument) if base}

    @property
    def chunking(self) -> bool:
        return self.chunked_prefill_size > 0

    def served_context_length(self, model_context: int) -> int:
        """The context served for a model whose own is `model_context` (`served_context_length`)."""
        return served_context_length(model_context, self.context_length)

    def resolved_device(self) -> str:
        """The concrete device: `auto` becomes cuda when torch sees a GPU, else cpu."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_dtype(self) -> str:
        """The concrete dtype name: `auto` is float32 on cpu and bfloat16 on a GPU."""
        if self.dtype != "auto":
            return self.dtype
        return "float32" if self.resolved_device() == "cpu" else "bfloat16"

    def resolved_attention_backend(self) -> str:
        """The concrete backend: `auto` is triton on cuda when it is installed (the torch backend's graph path
        gathers the table's full width for every row and layer), torch otherwise."""
        if self.attention_backend != "auto":
            return self.attention_backend
        on_cuda = self.resolved_device().startswith("cuda")
        return "triton" if on_cuda and "triton" in backend_names() else "torch"

    def overlap_enabled(self) -> bool:
        """Whether the engine runs the overlap loop (`overlap_schedule`, auto = on cuda only)."""
        if self.overlap_schedule == "auto":
            return self.resolved_device().startswith("cuda")
        return self.overlap_schedule == "on"

    def graph_max_bs(self) -> int:
        """Largest decode batch run from a graph (CUDA graphs on a GPU, compiled on a CPU): 0 (none) with
        --disable-cuda-graph, else `cuda_graph_max_bs` capped at `max_running_requests`."""
        if self.disable_cuda_graph or (self.enable_deterministic_inference and self.resolved_device() == "cpu"):
            return 0  # a compiled CPU graph's norms and activations are Inductor's sums, not the eager step's
        return min(self.cuda_graph_max_bs, self.max_running_requests)

    def kv_pool_tokens(self, bytes_per_token: int, context_length: int,
                       memory: MemoryBudget | None = None) -> int:
        """KV slots to allocate (`kv_pool_plan`'s size)."""
        return self.kv_pool_plan(bytes_per_token, context_length, memory)[0]

    def kv_pool_plan(self, bytes_per_token: int, context_length: int,
                     memory: MemoryBudget | None = None) -> tuple[int, dict[str, str]]:
        """(KV slots to allocate, how they were chosen and the bytes one token's KV takes, for `/get_server_info`
        → `kv_pool`).

        `max_total_tokens` when set. Otherwise on a CPU a fraction of the memory the process may ever use
        (`MemoryBudget.total`: MemTotal or the cgroup limit, which do not move between starts), rounded down
        to a power of two (`stable_pool_tokens`), then halved while it would take more than half of what is
        available now, so it is never more than fits; `memory` overrides the reading (tests). On a GPU a
        fraction of the free GPU memory after the weights, rounded to `POOL_ROUNDING`. Both are capped at
        what `max_running_requests` full-context requests could use. Logs what the size came from.
        """
        log = logging.getLogger("engine")
        cap = self.max_running_requests * context_length
        if self.max_total_tokens:
            log_event(log, logging.INFO, "sized the KV pool", tokens=self.max_total_tokens,
                      sized_from="--max-total-tokens", bytes_per_token=bytes_per_token)
            return self.max_total_tokens, {"tokens": str(self.max_total_tokens), "sized_from": "--max-total-tokens",
                                           "bytes_per_token": str(bytes_per_token)}
        device = self.resolved_device()
        fields: dict[str, object]
        if device.startswith("cuda"):
            import torch

            free, _ = torch.cuda.mem_get_info(torch.device(device))
            fraction = self.mem_fraction_static or GPU_MEM_FRACTION
            fields = {"sized_from": "free GPU memory", "available_bytes": free}
            tokens = min(int(free * fraction // bytes_per_token), cap)
            if tokens > POOL_ROUNDING:
                tokens -= tokens % POOL_ROUNDING
            tokens, halved = max(1, tokens), 0
        else:
            memory = memory or available_memory()
            fraction = self.mem_fraction_static or CPU_MEM_FRACTION
            total, total_source = memory.total
            tokens, halved = stable_pool_tokens(total * fraction, memory.bytes * POOL_SAFE_SHARE,
                                                bytes_per_token, cap)
            fields = {"sized_from": f"{fraction:g} of {total_source}", "total_bytes": total, **memory.fields()}
        log_event(log, logging.INFO, "sized the KV pool", tokens=tokens, bytes_per_token=bytes_per_token,
                  pool_bytes=tokens * bytes_per_token, fraction=fraction, capped_by_running_requests=tokens == cap,
                  halved_to_fit=halved, **fields)
        report = {"tokens": str(tokens), "sized_from": str(fields["sized_from"]), "bytes_per_token": str(bytes_per_token),
                  "pool_bytes": str(tokens * bytes_per_token), "capped_by_running_requests": str(tokens == cap)}
        if "total_bytes" in fields:
            report.update(total_bytes=str(fields["total_bytes"]), available_bytes=str(fields["available_bytes"]),
                          halved_to_fit=str(halved))
        return tokens, report

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Add one `--flag` per field to `parser`, each in its group (model, engine, scale-out, ...)."""
        flag_fields.add_arguments(cls, parser)

    @classmethod
    def add_argument(cls, parser: argparse.ArgumentParser, name: str) -> None:
        """Add the flag of field `name` alone: another actor that honours it too (the tokenizer's
        --grammar-warm-up) takes it as declared here."""
        flag_fields.add_arguments(cls, parser, names=[name])

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineConfig:
        """The config the flags of `add_arguments` describe."""
        return flag_fields.from_args(cls, args)

    def to_argv(self) -> list[str]:
        """Flags that reproduce this config (only the fields that differ from the defaults)."""
        return flag_fields.to_argv(self)


def _lora_entries(argument: str) -> list[tuple[str, str, str]]:
    """One `--lora-modules` argument's (name, path, base model name or "") triples: vLLM's JSON object, or
    name=path entries separated by commas or spaces."""
    if argument.lstrip().startswith("{"):
        try:
            spec = json.loads(argument)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--lora-modules: {argument!r} is not a JSON object ({exc})") from None
        if not isinstance(spec, dict):
            raise ValueError(f"--lora-modules: {argument!r} is not a JSON object")
        unknown = sorted(set(spec) - set(LORA_JSON_KEYS) - set(LORA_JSON_OPTIONAL))
        if unknown:
            raise ValueError(f"--lora-modules: key {unknown[0]!r} is not taken; give "
                             f"{', '.join(LORA_JSON_KEYS + LORA_JSON_OPTIONAL)}")
        if not all(isinstance(spec.get(key), str) and spec[key] for key in LORA_JSON_KEYS):
            raise ValueError(f"--lora-modules: a JSON adapter needs a name and a path (strings), got {argument!r}")
        base = spec.get("base_model_name", "")
        if not isinstance(base, str):
            raise ValueError(f"--lora-modules: base_model_name is a string, got {argument!r}")
        return [(spec["name"], spec["path"], base)]
    entries = []
    for entry in argument.replace(",", " ").split():
        name, sep, path = entry.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes name=path entries or JSON objects, got {entry!r}")
        entries.append((name, path, ""))
    return entries


def stable_pool_tokens(budget_bytes: float, fits_bytes: float, bytes_per_token: int, cap: int) -> tuple[int, int]:
    """(tokens, times halved): `budget_bytes` of KV rounded down to a power of two of tokens and capped at `cap`,
    then halved while it takes more than `fits_bytes`. A steady budget gives one size at every start, and
    the available memory changes it only when it crosses a factor of two (the pool's shape is part of a
    compiled decode graph, so each new size compiles them again)."""
    tokens = max(1, int(budget_bytes // bytes_per_token))
    tokens = min(1 << (tokens.bit_length() - 1), cap)
    halved = 0
    while tokens > 1 and tokens * bytes_per_token > fits_bytes:
        tokens //= 2
        halved += 1
    return max(1, tokens), halved


def available_host_memory(cgroup_root: str = CGROUP_ROOT) -> int:
    """Bytes of memory available to new allocations: Linux MemAvailable (total RAM elsewhere), capped by the
    headroom of this process's memory cgroup (v2 `memory.max`, v1 `memory.limit_in_bytes`) when it has a
    limit. `cgroup_root`: where the cgroup filesystem is mounted (tests pass a directory of fake files)."""
    return available_memory(cgroup_root).bytes
