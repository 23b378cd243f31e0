"""The engine the scheduler actor drives: request intake, continuous batching, one forward per step.

A step has three parts: `schedule()` decides the batch and does all allocation (retraction, admission,
prefix locks, KV slots), `launch(batch)` queues the forward and the sampling on the device and accounts for
it (requests whose prefill completes join the running set, finished prefill chunks go to the prefix cache),
`finish(batch, out)` applies the sampled tokens on the host (stop checks, caching, freeing) and returns one
output row per sampled request. Single-threaded by contract: `add_request`, `abort` and the control methods
are called only between steps. `EngineCore` implements `ringserve.actors.engine.interface.EngineInterface`, all the
scheduler actor uses of it.

A step never needs the host to have seen the tokens of the step before: its input ids are gathered on the
device from `TokenTable.ids`, where each step's sampling writes its tokens, and each request counts the
tokens it has on the device (`Req.device_len`, one ahead of `Req.ids` while its token is in flight), which is
what positions, slots and the seeded sampler's output index follow. The plain loop runs schedule, launch,
finish in turn. The overlap loop (`--overlap-schedule`, on for cuda) plans and launches step N+1 while step N
still runs on the device, and only then applies N's tokens, so the host's work hides behind the device's.
Both loops build every batch with the same `schedule()`. Steps that admit requests overlap too (every token
of an admitted request is known on the host). A request whose tokens on the device already end it by length
is not scheduled again; one that step N finishes by a stop token or string has computed one token too many
in N+1, which is dropped. Only a retraction, or a pool too short to decode every running request, drains:
the step in flight is applied first, then the next is planned. `overlapped_steps` and `drained_steps` count
the two kinds of launch.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from typing import Any

import torch

from ringserve.actors.engine.speculative.draft_model import DraftModel, load_draft_engine
from ringserve.actors.engine.speculative.speculator import Speculator
from ringserve.actors.engine.speculative.verify_step import SpeculativeSteps
from ringserve.actors.engine.core.batch import Batch, ForwardOutput
from ringserve.actors.engine.scheduling.cache_manager import CacheManager
from ringserve.actors.engine.config import EngineConfig
from ringserve.actors.engine.execution_plan import ExecutionPlan, resolve_execution
from ringserve.actors.engine.scheduling.decode import DecodeManager
from ringserve.actors.engine.scheduling.engine_control import EngineControl
from ringserve.actors.engine.scheduling.engine_stats import EngineStats, StartupReport, StepCounters
from ringserve.actors.engine.scheduling.grammar import GrammarManager
from ringserve.actors.engine.scheduling.jump_forward import JumpForward
from ringserve.actors.engine.runner.kv_pool import KVPool
from ringserve.actors.engine.models.causal_lm import CausalLM
from ringserve.actors.engine.runner.model_runner import ModelRunner
from ringserve.actors.engine.scheduling.prefill import PrefillManager
from ringserve.actors.engine.scheduling.step_finish import StepFinish
from ringserve.actors.engine.scheduling.step_pace import StepPace
from ringserve.actors.engine.scheduling.weight_swap import WeightSwap
from ringserve.actors.engine.quantization.quantize import apply_quantization, quantization_report
from ringserve.actors.engine.scheduling.prefix_cache import create_prefix_cache
from ringserve.actors.engine.scheduling.kv_sharing import KvShare
from ringserve.actors.engine.kv_tier.tier import make_tier
from ringserve.actors.engine.core.request import Req
from ringserve.actors.engine.scheduling.images import step_override
from ringserve.actors.engine.scheduling.request_ends import RequestEnds
from ringserve.actors.engine.scheduling.request_intake import RequestIntake
from ringserve.actors.engine.lora.adapter import Adapter
from ringserve.actors.engine.lora.pool import LoraPool
from ringserve.actors.engine.lora.serving import LoraServing
from ringserve.actors.engine.scheduling.stop_checker import StopChecker
from ringserve.actors.engine.runner.graphs.thread_tuner import tuner_for
from ringserve.actors.engine.runner.token_table import TokenTable
from ringserve.actors.engine.interface import StepPlan
from ringserve.bus.errors import ApiError
from ringserve.bus.messages import FinishReason, SchedulerInfo, TokenizedRequest, TokenRow

IDLE_COMPILE_WAIT = 0.05  # seconds a step with nothing to run waits for a grammar compilation
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
log = logging.getLogger("engine")


class EngineCore:
    """Continuous batching with chunked prefill and a prefix cache over a registry model and a paged KV pool. Parts
    it owns take new requests (`intake`), apply a step's tokens (`finishing`), end requests (`ends`), answer the
    operator (`control`), report (`report`), serve LoRA adapters (`adapters`) and share KV with other replicas
    (`kv_share`)."""

    def __init__(self, model: CausalLM, config: EngineConfig, tokenizer: Any | None = None,
                 model_name: str = "", draft: EngineCore | None = None,
                 execution: ExecutionPlan | None = None) -> None:
        """`model` already on `config`'s device; `tokenizer` is needed only by requests with stop strings;
        `model_name` is what `stats()` reports; `draft`: the draft model's engine (`--speculative-algorithm
        draft`); `execution`: the plan `config` was resolved to before the model was built (`resolve_execution`,
        resolved here when not given), run over the model's own build choices (`ExecutionPlan.running`)."""
        self.config = config
        self.execution = (execution or resolve_execution(config)).running(model.execution)
        self.device = torch.device(config.resolved_device())
        self.vocab_size: int = model.vocab_size
        self.context_length: int = config.served_context_length(model.context_length)  # --context-length
        self.tokenizer = tokenizer
        dtype, head_dim, layers = model.dtype, model.head_dim, model.num_layers
        kv_heads = model.num_kv_heads  # this rank's share under tensor parallelism
        per_token = KVPool.bytes_per_token(layers, kv_heads, head_dim, dtype, model.latent_kv)
        num_slots, kv_pool_report = config.kv_pool_plan(per_token, self.context_length)
        self.pool = KVPool(layers, num_slots, kv_heads, head_dim, dtype, self.device, model.latent_kv)
        self.table = TokenTable(config.max_running_requests, min(self.context_length, num_slots), self.device,
                                self.pool.scratch_slot)
        prefix_cache = create_prefix_cache(not config.disable_radix_cache, self.device)
        self.cache = CacheManager(num_slots, prefix_cache, self.table, self.device)
        if config.kv_tier_bytes:
            self.cache.use_tier(make_tier(self.pool, model, config))
        chunk = config.chunked_prefill_size if config.chunking else 0
        self.prefill = PrefillManager(self.cache, config.max_prefill_tokens, chunk, config.schedule_policy,
                                      config.max_running_requests)
        self.rope_rule = model.rope_length_rule  # longrope/dynamic: each request's rotary floor (models/rope.py)
        self.decode = DecodeManager(self.cache, self.context_length, self.rope_rule)
        # a vision-language model: the token its images' runs repeat (None: it takes no images)
        self.image_token_id: int | None = getattr(model, "image_token_id", None)
        self.prefill.whole_images = bool(getattr(model, "bidirectional_images", False))
        # chunks cut to keep steps short on a busy host (step_pace.py); never where outputs must not depend on timing
        if not config.enable_deterministic_inference:
            self.prefill.pace = StepPace()
        # LoRA wraps the linears after quantization (from_source) and before the runner captures the model
        self.lora = LoraPool(model, config.max_loras_per_batch, config.max_lora_rank, config.max_loaded_loras,
                             config.max_prefill_tokens + config.max_running_requests
                             * (config.speculative_num_draft_tokens + 1)) if config.lora_enabled() else None
        self.runner = ModelRunner(model, self.pool, self.table, self.execution)
        self.execution = self.runner.execution  # what runs (ModelRunner: no compiled graphs over a gathering backend)
        self.live: dict[str, Req] = {}
        self.adapters = LoraServing(self.lora, config.lora_dir, self.live)
        if self.lora is not None:
            self.adapters.start(self.runner.graphs is not None, config.lora_module_map())
            self.prefill.adapter_limit = config.max_loras_per_batch
            self.prefill.running_adapters = lambda: {r.params.lora_name for r in self.decode.running}
        self.runner.thread_tuner = tuner_for(config)
        self.counters = StepCounters()
        weights = WeightSwap(self.runner, self.pool, self.cache, self.decode, self.prefill,
                             lambda: self._inflight is not None)
        self.control = EngineControl(self.cache, self.runner, self.live, weights, self.lora is not None, model_name)
        self.kv_share = KvShare(self.cache, self.adapters, self.rope_rule)
        self.stop_checker = StopChecker(tokenizer, self.context_length)
        self.grammars = GrammarManager(tokenizer, self.vocab_size, config.grammar_compile_timeout)
        self.jumper = (JumpForward(self.grammars, self.stop_checker, self.decode, self.cache, self.prefill,
                                   self.context_length, self.device)
                       if not config.disable_jump_forward and prefix_cache.caches else None)
        if (config.speculative_algorithm == "draft") != (draft is not None):
            raise ValueError("--speculative-algorithm draft needs its draft model's engine, and only it takes one")
        self.speculation = None if config.speculative_algorithm == "none" else SpeculativeSteps(
            Speculator(config.speculative_num_draft_tokens, draft_model=DraftModel(draft) if draft else None),
            config.speculative_algorithm, self.cache, self.table, self.grammars, self.stop_checker)
        self.ends = RequestEnds(self.live, self.decode, self.prefill, self.grammars, self.cache, self.speculation,
                                self.counters)
        self.finishing = StepFinish(self.live, self.grammars, self.stop_checker, self.jumper, self.speculation,
                                    self.ends)
        self.intake = RequestIntake(model, self.context_length, num_slots, tokenizer is not None,
                                    config.embedding_pooling, self.device, self.adapters, self.grammars, self.prefill,
                                    self.live)
        self._last_batch: Batch | None = None
        self.overlap = config.overlap_enabled()
        self._inflight: tuple[Batch, ForwardOutput] | None = None  # overlap loop: launched, not yet finished
        fused_layers = sum(layer.fused_decode for layer in model.decoder_layers())
        self.startup = StartupReport(num_slots, self.context_length, self.overlap, kv_pool_report,
                                     quantization_report(model, config.enable_deterministic_inference),
                                     self.execution.report(fused_layers))
        self.report = EngineStats(config, self.startup, self.counters, self.cache, self.decode, self.prefill,
                                  self.control, self.adapters, self.speculation)

    @classmethod
    def from_source(cls, source: Any, config: EngineConfig, tokenizer: Any | None = None) -> EngineCore:
        """Load the model at `source` (a ModelSource: GGUF or safetensors) and build an engine."""
        from ringserve.actors.common.text_tokenizer import load_text_model
        from ringserve.actors.engine.models.weights import load_model

        execution = resolve_execution(config)  # every execution choice, before the model is built with it
        model = load_model(source, DTYPES[config.resolved_dtype()], config.resolved_device(), execution)
        apply_quantization(model, config, source)  # each quantized layer keeps its kernel plan (reported by stats())
        tokenizer = tokenizer if tokenizer is not None else load_text_model(source).tokenizer
        draft = load_draft_engine(cls, config, tokenizer) if config.speculative_algorithm == "draft" else None
        return cls(model, config, tokenizer, source.name, draft=draft, execution=execution)

    @property
    def num_slots(self) -> int:
        return self.pool.num_slots

    @property
    def takes_images(self) -> bool:
        """Whether the model is a vision-language model (requests may carry images)."""
        return self.image_token_id is not None

    def add_request(self, request: TokenizedRequest,
                    images: dict[str, dict[str, Any]] | None = None) -> ApiError | None:
        """`RequestIntake.add`: queue `request`, or say why it cannot run."""
        return self.intake.add(request, images)

    def has_work(self) -> bool:
        """True while a step's tokens are still to be applied, or requests wait or run and the engine is not
        paused."""
        return bool(self._inflight or len(self.grammars)
                    or (not self.control.paused and (len(self.prefill) or len(self.decode))))

    def step(self) -> list[TokenRow]:
        """Schedule, run and finish one step; one output row per request that produced a token (in the overlap
        loop: the rows of the step launched by the previous call, whose tokens are applied now).

        If the forward fails, every request of the batch ends with an "error" finish and the engine goes on.
        """
        self.counters.steps += 1
        started = time.perf_counter()
        with self.runner.graphs.serving() if self.runner.graphs is not None else nullcontext():
            rows = self._admit_compiled()
            if self.overlap:
                rows += self._step_overlapped()
            else:
                batch = self._last_batch = self.schedule()
                if batch is not None:
                    try:
                        out = self.launch(batch)
                    except Exception as exc:
                        return rows + self._fail_batch(batch, exc)
                    rows += self.finish(batch, out)
                    if self.cache.tier is not None and batch.num_decode == 0:  # what a tier load competes with
                        self.cache.tier.note_prefill(time.perf_counter() - started, batch.num_tokens)
        if self._last_batch is None and self._inflight is None:  # idle but for grammars still compiling
            self.grammars.wait(IDLE_COMPILE_WAIT)
        elif self.prefill.pace is not None and self._last_batch is not None:  # (overlap: about the step launched)
            self.prefill.pace.record(self._last_batch.num_tokens, time.perf_counter() - started)
        return rows

    def _admit_compiled(self) -> list[TokenRow]:
        """Queue the constrained requests whose grammar is ready; end those whose grammar failed."""
        if not self.grammars.pending:
            return []
        ready, failed = self.grammars.collect()
        for req in ready:
            self.prefill.add(req)
        rows = []
        for req, error in failed:
            del self.live[req.rid]
            rows.append(self.ends.row(req, [], FinishReason("error", error=error)))
        return rows

    def _step_overlapped(self) -> list[TokenRow]:
        prev, self._inflight = self._inflight, None
        if self.control.paused:
            return self.finish(*prev) if prev is not None else []
        rows: list[TokenRow] = []
        drained = False
        # Retraction needs every token applied, and so do a constrained request's next mask (a reasoning request's
        # while its phase may change: `Req.gate`) and the drafts of a request that speculates.
        if prev is not None and (self.decode.must_retract()
                                 or any(r.matcher or r.gate for r in prev[0].sampling_reqs)
                                 or self._speculates(prev[0].sampling_reqs) or self.decode.reencode_due()):
            rows, prev, drained = self.finish(*prev), None, True
        batch = self._last_batch = self.schedule()
        if batch is not None:
            if prev is not None:
                self.counters.overlapped_steps += 1
            elif drained:
                self.counters.drained_steps += 1
            try:
                self._inflight = (batch, self.launch(batch))
            except Exception as exc:
                rows += self._fail_batch(batch, exc)
        if prev is not None:
            rows += self.finish(*prev)
        return rows

    def _fail_batch(self, batch: Batch, exc: Exception) -> list[TokenRow]:
        log.exception("forward pass failed; ending the %d requests of its batch", len(batch.reqs))
        return [self.ends.fail(req, f"the forward pass failed: {exc!r}") for req in batch.reqs
                if self.live.get(req.rid) is req]

    def last_plan(self) -> StepPlan | None:
        """What the last `step` ran, as plain data (built only when asked: the scheduler's step spans)."""
        batch = self._last_batch
        if batch is None:
            return None
        d = batch.num_decode
        prefill = list(zip([r.rid for r in batch.reqs[d:]], batch.starts[d:], batch.extend_lens[d:]))
        return StepPlan([r.rid for r in batch.reqs[:d]], prefill, batch.num_tokens)

    def schedule(self) -> Batch | None:
        """Plan the next forward and allocate everything it needs; None when there is nothing to run.

        A step may be in flight (the overlap loop), unless a retraction is due (`DecodeManager.must_retract`).
        """
        for req in self.decode.retract_until_decodable():
            self.prefill.add(req, front=True)
            self.counters.num_retractions += 1
        for req in self.decode.retract_to_reencode():
            self.prefill.add(req, front=True)
        decodes = self.decode.schedule()
        drafts = self._draft(decodes)
        prefills = self.prefill.schedule(len(decodes))
        if not decodes and not prefills:
            return None
        return Batch.plan(decodes, drafts, prefills)

    def _speculates(self, reqs: list[Req]) -> bool:
        return self.speculation is not None and any(self.speculation.speculator.eligible(r) for r in reqs)

    def _draft(self, decodes: list[Req]) -> dict[Req, list[int]]:
        """Speculative decoding: drafts for the decode rows that speculate, leaving a slot per running request
        for the next step."""
        if self.speculation is None or not decodes:
            return {}
        rule, k = self.rope_rule, self.config.speculative_num_draft_tokens
        if rule is not None:  # a verify row never crosses into longrope's long factors (a re-encode comes first)
            decodes = [r for r in decodes if not rule.reencodes(r.rope_floor, r.device_len - 1 + k)]
        return self.speculation.draft(decodes, self.context_length, self.cache.available - len(self.decode))

    def launch(self, batch: Batch) -> ForwardOutput:
        """Queue the batch's forward and sampling on the device, then account for them as if done: each
        sampling request has one more token on the device, prefill chunks' KV is offered to the prefix cache
        (their token ids are known here; the device computes the KV before any later step reads it), and
        requests whose prefill completes start running, so the next step can decode them."""
        drafted = batch.drafted_before() if batch.drafts else ()
        if self.lora is not None:
            self.lora.prepare([r.params.lora_name for r in batch.reqs], batch.extend_lens)
        if self.takes_images:
            batch.override = step_override(self.runner.model, batch, self.table.table)
        out = self.runner.forward(batch, self.grammars.bitmask(batch.sampling_reqs, drafted))
        draft_rows = batch.draft_rows
        for i, (req, samples) in enumerate(zip(batch.reqs, batch.samples)):
            if samples and i not in draft_rows:
                req.device_len += 1
            if i >= batch.num_decode:
                self.cache.cache_req(req, finished=False)
                if samples:
                    self.decode.add(req)
        return out

    def finish(self, batch: Batch, out: ForwardOutput) -> list[TokenRow]:
        """`StepFinish.finish`: apply the sampled tokens (stop checks, prefix caching, freeing); the step's rows."""
        return self.finishing.finish(batch, out)

    def abort(self, rid: str) -> TokenRow | None:
        """`RequestEnds.abort`: end a live request now; its final row, or None if `rid` is not live."""
        return self.ends.abort(rid)

    def abort_all(self) -> list[TokenRow]:
        """`RequestEnds.abort_all`: every live request's final row."""
        return self.ends.abort_all()

    def live_rids(self) -> int:
        """Requests the engine holds state for."""
        return len(self.live)

    # EngineInterface's operator, LoRA and KV-sharing methods, answered by the parts that own them

    def stats(self) -> SchedulerInfo:
        """`EngineStats.info`: load, KV usage and settings."""
        return self.report.info()

    def start_decode_graphs(self) -> None:
        """`EngineControl.start_decode_graphs`: compile the CPU decode graphs in the background."""
        self.control.start_decode_graphs()

    def decode_graph_report(self) -> dict[str, str]:
        """`EngineControl.decode_graph_report` (safe from any thread)."""
        return self.control.decode_graph_report()

    def flush_cache(self) -> int:
        """`EngineControl.flush_cache`: the KV slots freed."""
        return self.control.flush_cache()

    def keep_prefix_cache(self) -> dict[str, Any]:
        """`EngineControl.keep_prefix_cache`: what was saved to the KV tier."""
        return self.control.keep_prefix_cache()

    def kv_events(self) -> tuple[list[bytes], list[bytes]]:
        """`EngineControl.kv_events`: the block hashes stored and evicted since the last call."""
        return self.control.kv_events()

    def check_integrity(self) -> None:
        """`EngineControl.check_integrity`."""
        self.control.check_integrity()

    def pause(self) -> None:
        """`EngineControl.pause`."""
        self.control.pause()

    def resume(self) -> None:
        """`EngineControl.resume`."""
        self.control.resume()

    def on_idle(self) -> None:
        """`EngineControl.on_idle`."""
        self.control.on_idle()

    def update_weights(self, checkpoint: Any, model_name: str, check_only: bool = False) -> int:
        """`EngineControl.update_weights`: the KV slots freed."""
        return self.control.update_weights(checkpoint, model_name, check_only)

    def read_lora(self, name: str, path: str) -> Adapter | ApiError:
        """`LoraServing.read` (safe on another thread while steps run)."""
        return self.adapters.read(name, path)

    def load_lora(self, name: str, path: str, adapter: Adapter | ApiError | None = None) -> ApiError | None:
        """`LoraServing.load`."""
        return self.adapters.load(name, path, adapter)

    def unload_lora(self, name: str) -> ApiError | None:
        """`LoraServing.unload`."""
        return self.adapters.unload(name)

    def kv_share_namespace(self) -> str | None:
        """`KvShare.namespace`."""
        return self.kv_share.namespace()

    def kv_cache_key(self, request: TokenizedRequest) -> str | None:
        """`KvShare.cache_key`."""
        return self.kv_share.cache_key(request)

    def kv_held_blocks(self, ids: list[int], cache_key: str | None) -> int:
        """`KvShare.held_blocks`."""
        return self.kv_share.held_blocks(ids, cache_key)

    def kv_export(self, ids: list[int], cache_key: str | None, first: int, count: int, budget: int) -> list[bytes]:
        """`KvShare.export_blocks`."""
        return self.kv_share.export_blocks(ids, cache_key, first, count, budget)

    def kv_import(self, ids: list[int], cache_key: str | None, first: int, payloads: list[bytes]) -> None:
        """`KvShare.import_blocks`."""
        self.kv_share.import_blocks(ids, cache_key, first, payloads)
