"""MEPIC's model runners: vLLM's runners, placing MEPIC requests' tokens.

vLLM numbers each request's scheduled tokens 0, 1, 2, ... and derives positions and KV slots from
those numbers. For a MEPIC request the numbers index its in-context tokens (see ``token_map``), so
right after vLLM prepares a step's inputs this runner rewrites, for those requests only, the
positions (to logical positions) and the KV slot mapping (to the padded layout inside the request's
block table), and hands the step's position tables to its attention builders. Chunk compiles
are ordinary sequences of the same batch. Everything else is vLLM's runner unchanged.

``MepicRunnerMixin`` holds that logic; ``MepicCPUModelRunner`` applies it to vLLM's CPU runner
(run and tested here) and ``worker/gpu_worker.py`` to the CUDA runner (untested: no GPU here).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
from vllm.v1.worker.cpu_model_runner import CPUModelRunner

from ascend_mepic.config import MepicConfig
from ascend_mepic.core.errors import MepicUnsupportedError
from ascend_mepic.core.plan import ChunkMove, ChunkSave, HostLoad, StepPlan, StepPlanError, TierLoad
from ascend_mepic.core.request_limits import table_width
from ascend_mepic.ops.layout import block_view
from ascend_mepic.tier import transfer as kv_transfer
from ascend_mepic.tier.host_store import StoredChunk, host_store
from ascend_mepic.tier.worker_io import WorkerTier
from ascend_mepic.vllm_integration import channel
from ascend_mepic.vllm_integration.draft_proposer import (
    MepicDraftModelProposer,
    install_drafter,
    is_vllm_draft_model_proposer,
)
from ascend_mepic.vllm_integration.runner_internals import (
    STEP_NOT_PLACED,
    fix_cpu_drafting_kernels,
    fix_cpu_rejection_kernels,
    hand_step_tables,
    quiet_numba_threads,
    rewrite_positions_and_slots,
    step_token_inputs,
    widen_block_table,
)
from ascend_mepic.worker import blend, step
from ascend_mepic.worker.draft_placement import DraftPlacement
from ascend_mepic.worker.nope_rotary import record_model_rope
from ascend_mepic.worker.token_map import TokenMap
from ascend_mepic.worker.token_pool import TokenMapPool


class MepicRunnerMixin:
    """Token placement for MEPIC requests; mixed into a vLLM ``GPUModelRunner`` subclass."""

    def _init_mepic(self, vllm_config) -> None:
        self.mepic_block_size = vllm_config.cache_config.block_size
        self._init_placement_state()
        self._plan: StepPlan | None = None
        self.mepic_blend_layer: int | None = None
        config = MepicConfig.from_additional_config(vllm_config.additional_config)
        self.mepic_enabled = config.enabled
        self.mepic_table_width = table_width(
            vllm_config.model_config.max_model_len, self.mepic_block_size,
            config.max_chunks_per_request,
        )  # fmt: skip
        policy = config.parsed_policy
        self._store = host_store(config.store_root(vllm_config)) if policy.loads_kv else None
        tier = config.tier
        self._tier = (
            WorkerTier(
                tier, Path(config.store_root(vllm_config)) / "tier", vllm_config.model_config.model
            )
            if tier.enabled
            else None
        )
        self._step_loaded = False  # this step's time includes tier loads (not a compute sample)
        # n-gram speculation looks drafts up in each MEPIC request's real prompt (every chunk
        # token), not in the in-context stream vLLM's input batch holds: request id -> (real
        # prompt, in-context tokens).
        spec = vllm_config.speculative_config
        if self.mepic_enabled and getattr(spec, "method", None) == "ngram":
            self._lookup_prompts = {}
        if self.mepic_enabled and is_vllm_draft_model_proposer(getattr(self, "drafter", None)):
            self._install_mepic_drafter(vllm_config)
        if policy.dynamic:
            if not vllm_config.model_config.enforce_eager:
                raise ValueError(f"policy {policy.name!r} needs enforce_eager=True")
            self.mepic_blend_layer = policy.check_layer

    def _install_mepic_drafter(self, vllm_config) -> None:
        """A draft model's batches placed by this runner's token maps (``draft_placement``),
        so the drafter attends over each request's logical context, chunk tokens included."""
        draft = vllm_config.speculative_config.draft_model_config
        target = (self.model_config.get_num_kv_heads(self.parallel_config),
                  self.model_config.get_head_size())  # fmt: skip
        if (draft.get_num_kv_heads(self.parallel_config), draft.get_head_size()) != target:
            raise MepicUnsupportedError(
                "MEPIC needs a draft model with the target's KV heads and head size: its caches "
                "share the target's blocks, and chunk moves and loads view every layer's cache "
                "with one geometry"
            )
        self._draft_placement = DraftPlacement(self._token_pool)
        drafter = MepicDraftModelProposer(vllm_config, self.device, self, self._draft_placement)
        install_drafter(self, drafter)

    def mepic_shutdown(self) -> None:
        """The worker is shutting down: let the tier's latest puts reach its shared backend."""
        tier, self._tier = getattr(self, "_tier", None), None
        if tier is not None:
            tier.close()

    def _init_placement_state(self) -> None:
        """The token maps of live sequences (a pool row each; see ``token_pool``)."""
        self._token_pool = TokenMapPool(self.mepic_block_size)
        self._draft_placement: DraftPlacement | None = None
        self._lookup_prompts: dict[str, tuple[np.ndarray, int]] | None = None

    def mepic_kv_buffers(self) -> list[torch.Tensor]:
        """Per-layer KV as ``tier.transfer`` reads it: logical ``[num_blocks, 2, B, Hkv, D]``
        views (``ops.layout.block_view``) of the buffers vLLM's CPU and GPU runners allocate.
        Built per call: only chunk moves, loads and saves use them. The NPU runner overrides this
        to view vllm-ascend's per-layer (K, V) pairs."""
        num_kv_heads = self.model_config.get_num_kv_heads(self.parallel_config)
        head_size = self.model_config.get_head_size()
        return [block_view(c, num_kv_heads, head_size) for c in self.kv_caches]

    def may_reinitialize_input_batch(self, kv_cache_config, *args, **kwargs):
        """vLLM's (or vllm-ascend's) input batch, with block-table rows as wide as MEPIC's
        tables (``core.request_limits``; ``vllm_integration.runner_internals.widen_block_table``
        says why)."""
        out = super().may_reinitialize_input_batch(kv_cache_config, *args, **kwargs)
        if self.mepic_enabled:
            table = self.input_batch.block_table[0]
            widen_block_table(table, self.mepic_block_size, self.mepic_table_width)
        return out

    def _update_states(self, scheduler_output):
        """Take this step's plan: token maps of new sequences, then host and tier loads."""
        for req_id in scheduler_output.finished_req_ids:
            self._token_pool.remove(req_id)
            if self._lookup_prompts is not None:
                self._lookup_prompts.pop(req_id, None)
        plan = channel.receive(scheduler_output) if self.mepic_enabled else None
        self._plan = plan
        if plan is not None:
            self._take_placements(plan, scheduler_output.scheduled_new_reqs)
        out = super()._update_states(scheduler_output)  # zeroes the step's new blocks
        if plan is not None and plan.chunk_moves:
            self._move_chunks(plan.chunk_moves)
        if plan is not None and plan.host_loads:
            self._load_chunks(plan.host_loads)
        if plan is not None and plan.tier_loads:
            self._load_from_tier(plan.tier_loads)
        return out

    def _take_placements(self, plan: StepPlan, new_reqs) -> None:
        by_id = {new.req_id: new for new in new_reqs}
        unknown = sorted(set(plan.placements) - set(by_id))
        if unknown:
            raise StepPlanError(
                f"step {plan.step}: the plan places sequences the step does not schedule: "
                f"{unknown[:4]}"
            )
        for req_id, placement in plan.placements.items():
            received = len(by_id[req_id].prompt_token_ids or ())
            if received != placement.num_in_context:
                raise StepPlanError(
                    f"step {plan.step}: request {req_id} arrived with {received} prompt tokens "
                    f"but its plan places {placement.num_in_context}"
                )
            tmap = TokenMap.from_placement(placement, self.mepic_block_size)
            ratio = placement.blend[0] if placement.blend is not None else None
            self._token_pool.add(req_id, tmap, ratio, decodes=not placement.compile)
            if self._lookup_prompts is not None and not placement.compile:
                real = (t for seg in placement.layout.segments for t in seg.token_ids)
                self._lookup_prompts[req_id] = (np.fromiter(real, np.int64), received)

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
        """vLLM's drafting, except that n-gram drafts of MEPIC requests are looked up in the
        request's real prompt and its output: an answer that copies a chunk's text past the
        chunk's first tokens finds it (the input batch holds only the in-context stream).
        Drafts never change greedy outputs, only how many tokens each verification accepts."""
        prompts = self._lookup_prompts
        batch = self.input_batch
        req_ids = batch.req_ids[: len(sampled_token_ids)]  # the step's rows, in order
        if not prompts or not any(r in prompts for r in req_ids):
            return super().propose_draft_token_ids(
                scheduler_output, sampled_token_ids, *args, **kwargs
            )
        self._draft_probs = self._draft_prob_req_ids = None  # as vLLM's n-gram branch does
        lengths = batch.num_tokens_no_spec[: len(req_ids)].copy()
        streams = []
        for i, req_id in enumerate(req_ids):
            n = int(lengths[i])
            found = prompts.get(req_id)
            row = batch.token_ids_cpu[i, :n]
            if found is not None:  # the real prompt, then what followed the in-context stream
                row = np.concatenate([found[0], row[found[1] :]])
            streams.append(row)
        lengths[:] = [len(row) for row in streams]
        tokens = np.zeros((len(req_ids), max(1, int(lengths.max()))), batch.token_ids_cpu.dtype)
        for i, row in enumerate(streams):
            tokens[i, : len(row)] = row
        return self.drafter.propose(
            scheduler_output.num_spec_tokens_to_schedule, sampled_token_ids, lengths, tokens
        )

    def _move_chunks(self, moves: tuple[ChunkMove, ...]) -> None:
        """Copy relocated chunks' canonical tokens (sources stay untouched until the step ran,
        so the copies may run in any order)."""
        bs = self.mepic_block_size
        caches = self.mepic_kv_buffers()
        for move in moves:
            kv = kv_transfer.save_tokens(
                caches, move.src_block_ids, move.src_offset, move.num_tokens, bs
            )
            kv_transfer.load_tokens(caches, kv, move.dst_block_ids, move.dst_offset, bs)

    def _load_from_tier(self, tier_loads: tuple[TierLoad, ...]) -> None:
        """Fill chunks' canonical blocks from the tier and report each verified outcome."""
        if self._tier is None:
            raise StepPlanError("the step plan has tier loads but this worker has no tier")
        for load in tier_loads:
            result = self._tier.load(
                load.chunk_id,
                self.mepic_kv_buffers(),
                list(load.block_ids),
                load.num_tokens,
                load.offset,
                self.mepic_block_size,
            )
            self._tier.dir.write_result(load.io_id, {load.chunk_id: result})
        self._tier.publish()
        self._step_loaded = True

    def _load_chunks(self, loads: tuple[HostLoad, ...]) -> None:
        """Fill request-private slots from the host store (before the forward pass)."""
        by_chunk: dict[str, list[HostLoad]] = {}
        for load in loads:
            by_chunk.setdefault(load.chunk_id, []).append(load)
        if self._store is None:
            raise StepPlanError("the step plan has host-store loads but this worker has no store")
        for chunk_id, group in by_chunk.items():
            stored = self._store.get(chunk_id)
            if stored is None:
                raise RuntimeError(f"chunk {chunk_id[:12]} is not in the host store")
            kv_transfer.load_stored_tokens(
                self.mepic_kv_buffers(),
                stored.kv,
                stored.num_tokens,
                [(x.offset, x.num_tokens, x.block_id, x.slot) for x in group],
                self.mepic_block_size,
            )
            self._store.record_load(stored, sum(x.num_tokens for x in group) / stored.num_tokens)

    def _save_compiles(self, saves: tuple[ChunkSave, ...]) -> None:
        """Keep this step's host-store compiles (right after the forward pass wrote them)."""
        if self._store is None:
            raise StepPlanError("the step plan has host-store saves but this worker has no store")
        for save in saves:
            kv = kv_transfer.save_blocks(self.mepic_kv_buffers(), list(save.block_ids))
            scores = None
            if save.with_scores:
                scores = kv_transfer.lowfreq_scores(
                    kv,
                    save.num_tokens,
                    self.model_config.get_num_kv_heads(self.parallel_config),
                    self.model_config.get_head_size(),
                )
            self._store.put(save.chunk_id, StoredChunk(kv, save.num_tokens, scores))

    def execute_model(self, scheduler_output, *args, **kwargs):
        start = time.perf_counter()
        hand_step_tables(self, STEP_NOT_PLACED)
        try:
            out = super().execute_model(scheduler_output, *args, **kwargs)
        finally:
            hand_step_tables(self, None)  # outside a step, builders see no MEPIC tables
        plan, self._plan = self._plan, None
        if plan is not None and plan.host_saves:
            self._save_compiles(plan.host_saves)
        if self._tier is not None:
            tokens = scheduler_output.total_num_scheduled_tokens
            if tokens >= self.mepic_block_size and not self._step_loaded:
                self._tier.note_compute(time.perf_counter() - start, tokens)  # prefill-sized
            self._step_loaded = False
            if plan is not None and plan.tier_puts:
                self._offload_to_tier(plan.tier_puts)
        return out

    def _offload_to_tier(self, puts: tuple[ChunkSave, ...]) -> None:
        """Write-through: this step's compiled chunks go to the tier right after the forward."""
        assert self._tier is not None
        caches = self.mepic_kv_buffers()
        for put in puts:
            kv = kv_transfer.save_tokens(
                caches, put.block_ids, put.offset, put.num_tokens, self.mepic_block_size
            )
            self._tier.put(put.chunk_id, kv, put.num_tokens)
        self._tier.publish()

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens_np):
        out = super()._prepare_inputs(scheduler_output, num_scheduled_tokens_np)
        self._place_tokens(scheduler_output.total_num_scheduled_tokens)
        return out

    def _place_tokens(self, num_tokens: int) -> None:
        """Rewrite positions and KV slots of mapped sequences and hand the step's tables to
        the builders: once per step, as array operations over the whole batch."""
        req_ids, query_start_loc, positions, block_table = step_token_inputs(self, num_tokens)
        placed = step.place_step(
            self._token_pool, req_ids, query_start_loc, positions, block_table,
            self.mepic_blend_layer,
        )  # fmt: skip
        if self._draft_placement is not None:  # before MEPIC rewrites vLLM's indices
            self._draft_placement.note_step(req_ids, positions)
        if placed.any_mapped:
            rewrite_positions_and_slots(
                self, num_tokens, placed.positions, placed.slots, placed.mapped
            )
        hand_step_tables(self, placed)

    def load_model(self, *args, **kwargs):
        out = super().load_model(*args, **kwargs)
        drafter = getattr(self, "drafter", None)  # MEPIC's attention runs a draft model too
        draft_model = drafter.model if isinstance(drafter, MepicDraftModelProposer) else None
        record_model_rope(self.model, draft_model)
        if self.mepic_blend_layer is not None:
            blend.install_layer_gates(self.model, self.mepic_blend_layer)
        return out


class MepicWorkerMixin:
    """MEPIC's part of a worker's shutdown, mixed into the CPU, GPU and NPU workers."""

    def shutdown(self) -> None:
        runner = getattr(self, "model_runner", None)
        if isinstance(runner, MepicRunnerMixin):
            runner.mepic_shutdown()
        super().shutdown()  # type: ignore[misc]


class MepicCPUModelRunner(MepicRunnerMixin, CPUModelRunner):
    def __init__(self, vllm_config, device: torch.device) -> None:
        if getattr(vllm_config.speculative_config, "method", None) == "ngram":
            quiet_numba_threads()
        super().__init__(vllm_config, device)
        self._init_mepic(vllm_config)

    def _postprocess_triton(self) -> None:
        """vLLM's CPU kernel rebinding, and the rejection sampler's and the drafter step's it
        misses (speculative decoding; ``runner_internals.fix_cpu_rejection_kernels`` and
        ``fix_cpu_drafting_kernels`` say why)."""
        super()._postprocess_triton()
        if self.speculative_config is not None:
            fix_cpu_rejection_kernels()
            if self.speculative_config.uses_draft_model():
                fix_cpu_drafting_kernels()
