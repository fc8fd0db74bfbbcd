"""MepicScheduler: vLLM's scheduler with the chunk-aware KV manager swapped in.

Install with ``--scheduler-cls ascend_mepic.core.scheduler.MepicScheduler`` and turn MEPIC on with
``--additional-config '{"mepic": {}}'``. vLLM 0.30.0 builds its ``KVCacheManager`` inside
``Scheduler.__init__`` with no hook to choose another class, so this subclass replaces it right
after construction (``vllm_integration.scheduler_internals.install_kv_manager``), before any
block is allocated. With MEPIC off it is stock vLLM's scheduler.

Requests carrying ``extra_args["mepic_segments"]`` are validated when they arrive; a malformed
layout or one that can never fit the KV pool finishes at once with ``FINISHED_ERROR`` and a logged
reason, before anything is allocated, and never disturbs other requests.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from pathlib import Path
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler

from ascend_mepic.config import MepicConfig
from ascend_mepic.core.engine_support import check_engine_supported
from ascend_mepic.core.errors import MepicQuotaError
from ascend_mepic.core.identity import model_fingerprint, weights_digest
from ascend_mepic.core.kv_manager import MepicKVCacheManager
from ascend_mepic.core.kv_settings import KVSettings, StepBudgets
from ascend_mepic.core.policies import Placement
from ascend_mepic.core.request_intake import Inspected
from ascend_mepic.core.segments import UNPIN_KEY, LayoutError
from ascend_mepic.tier.host_store import host_store
from ascend_mepic.tier.index import TierIndex
from ascend_mepic.vllm_integration import block_hasher, channel
from ascend_mepic.vllm_integration.core_types import (
    EngineCoreOutputs,
    Request,
    RequestStatus,
    SchedulerOutput,
    get_hash_fn_by_name,
)
from ascend_mepic.vllm_integration.scheduler_internals import (
    add_pseudo_request,
    emit_finished_at_arrival,
    install_kv_manager,
    step_limits,
)
from ascend_mepic.vllm_integration.version import check_vllm_version

logger = logging.getLogger(__name__)


class MepicScheduler(Scheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        check_vllm_version()
        super().__init__(*args, **kwargs)
        self.mepic_config = MepicConfig.from_additional_config(self.vllm_config.additional_config)
        self.mepic_errors: dict[str, tuple[int, str]] = {}  # request id -> (client, reason)
        # Recent refusals at arrival, (request id, reason, HTTP status), published in the stats
        # file at once so the API server can tell its client why (the engine's output carries
        # only finish reason "error").
        self.recent_rejections: deque[tuple[str, str, int]] = deque(maxlen=64)
        self._rejections_unpublished = False
        self._finished_at_arrival: dict[str, tuple[int, RequestStatus]] = {}
        self._stats_written_at = 0.0
        if not self.mepic_config.enabled:
            return
        check_engine_supported(
            self.vllm_config,
            self.mepic_config.parsed_policy,
            self.mepic_config.tier.enabled,
        )
        self.pic_policy = self.mepic_config.parsed_policy
        self._step_count = 0
        self._batch = (self.max_num_scheduled_tokens, self.max_num_running_reqs)
        self._compiles_to_finish: set[str] = set()
        # Requests of loading policies wait here until their chunks are in the host store.
        # (request, its layout, its chunk ids), inspected once at arrival.
        self._staged: dict[str, tuple[Request, Inspected]] = {}
        old = self.kv_cache_manager
        model = self.vllm_config.model_config
        self.kv_settings = self._kv_settings()
        manager = MepicKVCacheManager(
            kv_cache_config=old.kv_cache_config,
            max_model_len=old.max_model_len,
            max_in_flight_tokens=self.vllm_config.max_in_flight_tokens,
            enable_caching=old.enable_caching,
            use_eagle=old.use_eagle,
            num_prefill_lookahead=self.num_prefill_lookahead,
            dcp_world_size=self.dcp_world_size,
            log_stats=old.log_stats,
            enable_kv_cache_events=old.enable_kv_cache_events,
            scheduler_block_size=self.block_size,
            hash_block_size=old.block_pool.hash_block_size,
            metrics_collector=old.metrics_collector,
            watermark=self.scheduler_config.watermark,
            hash_fn=get_hash_fn_by_name(self.cache_config.prefix_caching_hash_algo),
            model_fingerprint=model_fingerprint(
                model.model,
                str(model.dtype),
                model.revision,
                weights=weights_digest(model.model, model.revision),
            ),
            settings=self.kv_settings,
        )
        install_kv_manager(self, manager)
        if self.pic_policy.placement is not Placement.NONE:
            # Segmented requests are re-hashed by MEPIC: the engine core (built next) skips them.
            block_hasher.install()
        logger.info(
            "MEPIC scheduling path on: block size %d, %d KV blocks, compiles take up to %d "
            "tokens / %d sequences of a step, only in steps that issue them",
            self.block_size,
            old.kv_cache_config.num_blocks,
            *manager.compile_room(),
        )

    def _kv_settings(self) -> KVSettings:
        """The KV manager's settings, from MEPIC's configuration: made once, before it."""
        fraction = self.mepic_config.compile_token_fraction  # in (0, 1]: the config checked it
        model = self.vllm_config.model_config
        bos = getattr(model.hf_config, "bos_token_id", None)
        root = self.mepic_config.store_root(self.vllm_config)
        store = tier = None
        if self.pic_policy.loads_kv:
            store = host_store(root, owner=True)
        tier_config = self.mepic_config.tier
        if tier_config.enabled:
            host_store(root, owner=True)  # owns (and removes at exit) the shared directory
            tier = TierIndex(tier_config, Path(root) / "tier", model.model)
            logger.info("MEPIC chunk tier on: %s", tier_config)
        return KVSettings(
            policy=self.pic_policy,
            dummy_token_id=int(bos) if bos is not None else 0,
            store=store,
            tier=tier,
            max_chunks=self.mepic_config.max_chunks_per_request,
            pinned_fraction=self.mepic_config.pinned_kv_fraction,
            pinned_per_salt=self.mepic_config.max_pinned_blocks_per_salt,
            budgets=StepBudgets(
                *self._batch,
                int(self._batch[0] * fraction),
                whole_prefills=not self.scheduler_config.enable_chunked_prefill,
                compiles=self.pic_policy.placement is not Placement.NONE,
            ),
        )

    def shutdown(self) -> None:
        super().shutdown()
        from ascend_mepic.vllm_integration import front_end

        front_end.unregister(self.vllm_config)  # in-process engines: the front end's config

    @property
    def mepic_manager(self) -> MepicKVCacheManager | None:
        m = self.kv_cache_manager
        return m if isinstance(m, MepicKVCacheManager) else None

    def add_request(self, request: Request) -> None:
        manager = self.mepic_manager
        if (
            manager is None
            or self.pic_policy.placement is Placement.NONE
            or request.request_id in self.requests
        ):
            super().add_request(request)
            return
        extra = request.sampling_params.extra_args if request.sampling_params else None
        if extra and extra.get(UNPIN_KEY):
            super().add_request(request)
            try:
                count = manager.unpin_chunks(request)
                logger.info("MEPIC unpinned %d chunk(s) for request %s", count, request.request_id)
                status = RequestStatus.FINISHED_STOPPED
            except (LayoutError, ValueError) as e:
                self.mepic_errors[request.request_id] = (request.client_index, str(e))
                self._note_rejection(request.request_id, e)
                status = RequestStatus.FINISHED_ERROR
            self._finish_now(request, status)
            return
        try:
            stages = self.pic_policy.loads_kv or self.kv_settings.tier is not None
            found = manager.inspect(request) if stages else None
            if found is not None and (
                self.pic_policy.loads_kv or manager.tier_wanted(found[1], count=True)
            ):
                self._staged[request.request_id] = (request, found)
                return
            manager.track(request)
        except (LayoutError, ValueError) as e:
            self._reject(request, e)
            return
        super().add_request(request)

    def _reject(self, request: Request, error: Exception) -> None:
        logger.warning("MEPIC rejected request %s: %s", request.request_id, error)
        super().add_request(request)
        self.mepic_errors[request.request_id] = (request.client_index, str(error))
        self._note_rejection(request.request_id, error)
        self.kv_cache_manager.forget(request.request_id)
        self._finish_now(request, RequestStatus.FINISHED_ERROR)

    def _note_rejection(self, request_id: str, error: Exception) -> None:
        status = 429 if isinstance(error, MepicQuotaError) else 400
        self.recent_rejections.append((request_id, str(error), status))
        self._rejections_unpublished = True

    def _release_staged(self) -> None:
        """Staged requests whose chunks are all stored (host store) or loaded (tier) join vLLM's
        waiting queue (FIFO)."""
        manager = self.kv_cache_manager
        for request_id, (request, found) in list(self._staged.items()):
            chunk_ids = found.chunk_ids
            if self.pic_policy.loads_kv and not manager.chunks_stored(chunk_ids):
                continue
            if not self.pic_policy.loads_kv and manager.tier_wanted(chunk_ids):
                continue
            del self._staged[request_id]
            try:
                manager.track(request)
            except (LayoutError, ValueError) as e:
                self._reject(request, e)
                continue
            super().add_request(request)

    def _stage_compiles(self) -> None:
        manager = self.kv_cache_manager
        for request, (layout, chunk_ids, anchor) in self._staged.values():
            if self.pic_policy.loads_kv:
                manager.stage(request, layout, chunk_ids)
            else:
                manager.stage_tier_loads(layout, chunk_ids, request.cache_salt, anchor)

    def get_num_unfinished_requests(self) -> int:
        return super().get_num_unfinished_requests() + len(getattr(self, "_staged", ()))

    def finish_requests(self, request_ids: Any, finished_status: RequestStatus) -> Any:
        staged = getattr(self, "_staged", {})
        if request_ids is None:  # vLLM: every request (shutdown)
            staged.clear()
            return super().finish_requests(request_ids, finished_status)
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for request_id in ids:
            staged.pop(request_id, None)
        return super().finish_requests(ids, finished_status)

    def _finish_now(self, request: Request, status: RequestStatus) -> None:
        """Finish a request at arrival; its output (no tokens) goes out with the next step."""
        self._finished_at_arrival[request.request_id] = (request.client_index, status)
        self.finish_requests(request.request_id, status)

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        manager = self.mepic_manager
        if manager is None:
            return super().schedule(*args, **kwargs)
        if self._staged:
            self._release_staged()
        # Compile room is kept only for compiles a previous step had to defer; every other
        # step gives vLLM the whole batch (compiles then take what its requests leave).
        tokens, seqs = manager.take_compile_reserve()
        with step_limits(self, self._batch[0] - tokens, self._batch[1] - seqs):
            output = super().schedule(*args, **kwargs)
        if self._staged:
            self._stage_compiles()
        self._add_compiles(output)
        self._publish_stats()
        return output

    def _publish_stats(self, min_interval_s: float = 0.25) -> None:
        """Write the manager's metrics for the API server (atomic replace, rate-limited)."""
        path = self.mepic_config.stats_file
        now = time.monotonic()
        if not path or now - self._stats_written_at < min_interval_s:
            return
        self._stats_written_at = now
        manager = self.kv_cache_manager
        assert isinstance(manager, MepicKVCacheManager)
        payload = {
            "time": time.time(),
            "num_blocks": manager.num_blocks,
            "block_size": manager.mepic_block_size,
            "metrics": manager.metrics(),
            "recent_chunk_blocks": list(manager.recent_chunk_blocks)[-64:],
            "rejections": list(self.recent_rejections),
        }
        self._rejections_unpublished = False
        tmp = f"{path}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(payload, f)
            os.replace(tmp, path)
        except OSError as e:
            logger.warning("MEPIC could not write stats to %s: %s", path, e)

    def _add_compiles(self, output: SchedulerOutput) -> None:
        """Add this step's extra sequences (chunk compiles, tier loads) and send its plan.

        Neither kind is a vLLM request: each finishes with the step, and the worker forgets it.
        Everything the worker needs to place this step's tokens is in one ``StepPlan``
        (``KVCacheManager.take_step_plan``), sent on the output (``vllm_integration/channel.py``).
        """
        output.finished_req_ids |= self._compiles_to_finish
        self._compiles_to_finish = set()
        self._step_count += 1
        new_ids = (new.req_id for new in output.scheduled_new_reqs)  # new and resumed requests
        plan, extra = self.kv_cache_manager.take_step_plan(self._step_count, new_ids)
        for seq in extra:
            add_pseudo_request(output, seq.seq_id, list(seq.token_ids), list(seq.block_ids))
            self._compiles_to_finish.add(seq.seq_id)
        channel.attach(output, plan)

    def update_from_output(self, scheduler_output: SchedulerOutput, model_runner_output: Any):
        if self.mepic_manager is not None:
            self.mepic_manager.step_finished(scheduler_output.num_scheduled_tokens)
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if self._finished_at_arrival:
            self._emit_finished_at_arrival(outputs)
        if self.mepic_manager is not None:
            # Publish at once when the engine goes idle, so the last burst is never missing,
            # and when it refused a request, so its reason is there before its output leaves.
            now = self._rejections_unpublished or not self.has_unfinished_requests()
            self._publish_stats(0.0 if now else 0.25)
        return outputs

    def _emit_finished_at_arrival(self, outputs: dict[int, EngineCoreOutputs]) -> None:
        done, self._finished_at_arrival = self._finished_at_arrival, {}
        self.mepic_errors = {}
        emit_finished_at_arrival(outputs, done)
