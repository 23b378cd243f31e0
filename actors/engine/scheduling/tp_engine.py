"""One replica of `--tp N` ranks: rank 0's `TPEngine` (behind the engine interface) and the followers' `TPFollower`.

Rank 0 is an ordinary `EngineCore` over its shard of the model whose runner, before each forward, broadcasts the
step plan (`tp_plan.py`) to the followers; every follower builds the same pool, token table and runner over
its own shard (`TPFollower`) and runs the identical forward, so the two all-reduces of each layer
(`tensor_parallel.py`) meet. Only rank 0 samples, and only rank 0 drafts: with `--speculative-algorithm draft`
its draft model runs whole (unsharded, no collective) beside its shard, and the followers see verify steps as
decode rows of the plan. Images: rank 0 runs the vision tower and projector (unsharded: every rank loads them
whole, and only rank 0 uses them) and the plan carries the step's image embeddings to the followers
(`tp_plan.py`). LoRA adapters: each rank keeps its shard's slice of them; the plan names each row's
adapter and version, and a follower loads from disk the adapters it has not seen (or has in an older version). Collectives are serialised by one lock: a keepalive plan,
sent while rank 0 idles, never slips between a forward's plan and its all-reduces.

Failure: a collective that fails or times out breaks the group. Rank 0 then ends every live request with an
error, refuses new ones, and its next `step` raises `TPGroupError` (the scheduler actor fail-stops, so the
supervisor restarts the group whole); a follower's loop raises it and the follower exits.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import logging
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from ringserve.actors.engine.config import EngineConfig
from ringserve.actors.engine.scheduling.engine_core import EngineCore
from ringserve.actors.engine.scheduling.images import embed_step_images
from ringserve.actors.engine.runner.kv_pool import KVPool
from ringserve.actors.engine.core.embed_override import BidirectionalSpan, EmbedOverride
from ringserve.actors.engine.models.causal_lm import CausalLM
from ringserve.actors.engine.quantization.quantize import apply_quantization
from ringserve.actors.engine.parallel.model_sharding import shard_model
from ringserve.actors.engine.parallel.tensor_parallel import TPGroup, TPGroupError
from ringserve.actors.engine.parallel.tp_checks import check_tp_quantization
from ringserve.actors.engine.parallel.tp_plan import (FORWARD, KEEPALIVE, STOP, ForwardPlan, broadcast_image_embeds,
                                                      broadcast_plan, broadcast_step_tensors)
from ringserve.bus.errors import ApiError, server_error
from ringserve.bus.messages import SchedulerInfo, TokenizedRequest, TokenRow
from ringserve.kernels.attention import ForwardInfo
from ringserve.observability.logging import log_event

log = logging.getLogger("engine")
KEEPALIVE_S = 1.0  # rank 0 idle: a plan at least this often, well inside the followers' collective timeout


def prepare_rank(model: CausalLM, config: EngineConfig, group: TPGroup, expert_parallel: bool = False,
                 source: Any = None) -> EngineConfig:
    """Shard `model` for `group.rank` and quantize the shard as `config` says; the config every rank of the
    group runs: CUDA graphs off (a forward's collectives run eagerly on every rank) and the KV pool size all
    ranks agree on (the smallest any of them would allocate). A collective with every rank (startup timeout).
    `source`: where `model` was loaded from (a bfloat16 checkpoint's shards may run the bf16 kernel)."""
    check_tp_quantization(group.size, config.quantization)
    shard_model(model, group, expert_parallel)
    apply_quantization(model, config, source)  # `source`: a bfloat16 checkpoint may run the bf16 kernel
    if config.graph_max_bs():
        log_event(log, logging.INFO, "tensor parallelism runs every step eagerly: decode graphs are off", tp=group.size)
    config = dataclasses.replace(config, disable_cuda_graph=True)
    per_token = KVPool.bytes_per_token(model.num_layers, model.num_kv_heads, model.head_dim, model.dtype,
                                       model.latent_kv)
    context = config.served_context_length(model.context_length)  # --context-length
    tokens = torch.tensor([config.kv_pool_tokens(per_token, context)], device=group.device)
    dist.all_reduce(tokens, op=dist.ReduceOp.MIN)  # the default group: ranks load at different speeds
    return dataclasses.replace(config, max_total_tokens=int(tokens))


def startup_barrier(group: TPGroup) -> None:
    """Wait until every rank has built its engine (on the default group, with the rendezvous timeout)."""
    done = torch.ones(1, device=group.device)
    dist.all_reduce(done)


class TPEngine(EngineCore):
    """Rank 0 of a tensor-parallel replica: schedules, samples and answers for the whole group."""

    def __init__(self, model: CausalLM, config: EngineConfig, group: TPGroup, tokenizer: Any | None = None,
                 model_name: str = "", on_broken: Callable[[str], None] | None = None,
                 draft: EngineCore | None = None) -> None:
        """`model` already sharded and `config` from `prepare_rank`; `on_broken` is told (from the keepalive
        thread) when the group breaks while idle; `draft`: the whole draft model's engine (`EngineCore`'s)."""
        super().__init__(model, config, tokenizer, model_name, draft=draft)
        self.group = group
        self.on_broken = on_broken
        self.runner.tp_sender = self._send_forward
        self._lock = threading.Lock()  # one collective sequence at a time: a forward, or a keepalive
        self._last_sent = time.monotonic()
        self._closed = threading.Event()
        startup_barrier(group)
        self._keepalive = threading.Thread(target=self._keepalive_loop, name="tp-keepalive", daemon=True)
        self._keepalive.start()

    def _send_forward(self, rows: list[int], starts: list[int], extend_lens: list[int], input_ids: torch.Tensor,
                      info: ForwardInfo, override: EmbedOverride | None = None,
                      rope_floors: list[int] | None = None, rope_positions: list[int] | None = None) -> None:
        width = max(info.kv_lens_cpu)
        plan = ForwardPlan(FORWARD, list(rows), list(starts), list(extend_lens), width, live=len(self.live),
                           rope_floors=rope_floors, rope_positions=rope_positions)
        if self.lora is not None:
            plan.lora_names = list(self.lora.step_names)
            plan.lora_versions = self.lora.versions(plan.lora_names)
        if override is not None:
            plan.image_tokens = len(override.index)
            plan.image_spans = [[s.first, s.length, s.position] for s in override.spans]
            if override.rope_positions is not None:
                plan.image_rope = override.rope_positions.tolist()
        table_rows = info.token_table[info.req_rows, :width]
        group = self.group
        index = override.index if override is not None else None
        group.collective(lambda: broadcast_plan(plan, group.plan_group), "step plan broadcast")
        group.collective(lambda: broadcast_step_tensors(plan, input_ids, table_rows, group.tensor_group, group.device,
                                                        index), "step tensor broadcast")
        if override is not None:
            model = self.runner.model
            group.collective(lambda: broadcast_image_embeds(plan, override.embeds, model.config.hidden_size,
                                                            model.dtype, group.tensor_group, group.device),
                             "image embedding broadcast")
        self._last_sent = time.monotonic()

    def _keepalive_loop(self) -> None:
        while not self._closed.wait(KEEPALIVE_S / 4):
            if self.group.broken is not None:
                return
            if time.monotonic() - self._last_sent < KEEPALIVE_S or not self._lock.acquire(blocking=False):
                continue
            try:
                plan = ForwardPlan(KEEPALIVE, live=len(self.live))
                self.group.collective(lambda: broadcast_plan(plan, self.group.plan_group), "keepalive broadcast")
                self._last_sent = time.monotonic()
            except TPGroupError as exc:
                if self._closed.is_set():  # shutting down: the followers may have gone first
                    return
                log_event(log, logging.ERROR, "the tensor-parallel group broke while idle", error=str(exc))
                if self.on_broken is not None:
                    self.on_broken(str(exc))
                return
            finally:
                self._lock.release()

    def launch(self, batch: Any) -> Any:
        """`EngineCore.launch`, holding the group's lock across the plan, the forward and its all-reduces. The step's
        images are embedded first, outside the lock: keepalives reach the followers while the tower runs, however
        long it takes next to `--tp-timeout`."""
        if self.takes_images:
            embed_step_images(self.runner.model, batch)
        with self._lock:
            return super().launch(batch)

    def step(self) -> list[TokenRow]:
        """`EngineCore.step`; once the group broke, every live request ends with an error (this call), and the next
        call raises `TPGroupError`."""
        if self.group.broken is not None:
            raise TPGroupError(self.group.broken)
        rows = super().step()
        if self.group.broken is not None:
            self._inflight = None
            why = f"tensor-parallel replica failed: {self.group.broken}"
            rows += [self.ends.fail(req, why) for req in list(self.live.values())]
        return rows

    def has_work(self) -> bool:
        return self.group.broken is not None or super().has_work()

    def add_request(self, request: TokenizedRequest,
                    images: dict[str, dict[str, Any]] | None = None) -> ApiError | None:
        if self.group.broken is not None:
            return server_error(f"tensor-parallel replica failed: {self.group.broken}")
        return super().add_request(request, images)

    def stats(self) -> SchedulerInfo:
        """`EngineCore.stats`, with the replica's `tp_size`."""
        return dataclasses.replace(super().stats(), tp_size=self.group.size)

    def update_weights(self, checkpoint: Any, model_name: str, check_only: bool = False) -> int:
        raise ValueError(f"update_weights_from_disk is not supported with tensor parallelism (--tp {self.group.size})")

    def close(self) -> None:
        """Stop the keepalives and tell the followers to exit (best effort: the group may be broken)."""
        self._closed.set()
        self._keepalive.join(timeout=5)
        if self.group.broken is None and self._lock.acquire(timeout=5):
            try:
                self.group.collective(lambda: broadcast_plan(ForwardPlan(STOP), self.group.plan_group), "stop")
            except TPGroupError:
                pass
            finally:
                self._lock.release()


class TPFollower:
    """A follower rank: the engine's pool, token table and runner over its shard, driven by rank 0's plans."""

    def __init__(self, model: CausalLM, config: EngineConfig, group: TPGroup) -> None:
        """`model` already sharded and `config` from `prepare_rank`."""
        # the same construction as rank 0's (pool size, table width); its scheduling parts stay unused, and
        # drafting is rank 0's alone
        self.engine = EngineCore(model, dataclasses.replace(config, speculative_algorithm="none",
                                                        speculative_draft_model_path=""))
        self.group = group
        self.steps = 0
        self.live = 0  # rank 0's live requests, as of its last plan
        startup_barrier(group)

    def run_one(self) -> bool:
        """Receive one plan and run it; False once rank 0 said stop. Raises `TPGroupError` when rank 0 is gone."""
        group, engine = self.group, self.engine
        plan = group.collective(lambda: broadcast_plan(None, group.plan_group), "step plan receive")
        if plan.kind == STOP:
            return False
        self.live = plan.live
        if plan.kind == FORWARD:
            table = engine.table.table
            if max(plan.rows) >= table.shape[0] or plan.width > table.shape[1]:
                raise ValueError(f"plan rows {plan.rows} (width {plan.width}) are outside this rank's token "
                                 f"table {tuple(table.shape)}: the ranks were built differently")
            ids, table_rows, image_index = group.collective(
                lambda: broadcast_step_tensors(plan, None, None, group.tensor_group, group.device),
                "step tensor receive")
            table[torch.tensor(plan.rows, device=table.device), : plan.width] = table_rows
            override = self._image_override(plan, image_index) if plan.image_tokens else None
            if engine.lora is not None:
                engine.lora.sync(plan.lora_versions)
                engine.lora.prepare(plan.lora_names, plan.extend_lens)
            engine.runner.forward_tokens(plan.rows, plan.starts, plan.extend_lens, ids, override,
                                         rope_floors=plan.rope_floors, rope_positions=plan.rope_positions)
            self.steps += 1
        return True

    def _image_override(self, plan: ForwardPlan, index: torch.Tensor) -> EmbedOverride:
        """Receive the step's image embeddings; each span's key slots are its row's, from this rank's table."""
        group, model, table = self.group, self.engine.runner.model, self.engine.table.table
        embeds = group.collective(lambda: broadcast_image_embeds(plan, None, model.config.hidden_size, model.dtype,
                                                                 group.tensor_group, group.device),
                                  "image embedding receive")
        ends = list(itertools.accumulate(plan.extend_lens))
        spans = []
        for first, length, position in plan.image_spans:
            row = plan.rows[bisect.bisect_right(ends, first)]  # the batch row whose tokens hold flat index `first`
            spans.append(BidirectionalSpan(first, length, position, table[row, :position + length]))
        rope = None if plan.image_rope is None else torch.tensor(plan.image_rope, dtype=torch.int64, device=index.device)
        return EmbedOverride(index, embeds, spans, rope)

    def run(self, stopping: Callable[[], bool] = lambda: False) -> None:
        """Run plans until rank 0 says stop or `stopping()` (checked between plans)."""
        while not stopping() and self.run_one():
            pass
