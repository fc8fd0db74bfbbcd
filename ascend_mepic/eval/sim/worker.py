"""``SimulatedWorker``: a vLLM worker with no model and no device, for the serving simulator.

vLLM's engine core runs it through its own executor (``UniProcExecutor``) and worker hook
(``worker_cls``), exactly as it runs a real worker: the KV spec it reports is the model's (from
its config), the memory it reports is the device profile's, and every ``execute_model`` returns
one sampled token for each request whose prompt is done, as a real model runner would. Instead
of computing, it prices the step (``cost.step_seconds``) and advances the simulation clock.

What the scheduler can observe of a real worker, it reproduces: chunks a private-placement
policy saves to the host store after the forward pass are recorded there (an empty tensor, with
their token count), so requests staged on them are released as in the engine.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ascend_mepic.eval.sim.cost import ModelShape, StepTracker, StepWork, step_seconds
from ascend_mepic.eval.sim.profile import DeviceProfile, StepNoise
from ascend_mepic.vllm_integration.core_types import FullAttentionSpec
from ascend_mepic.vllm_integration.engine_core import (
    CompilationTimes,
    KVCacheSpec,
    ModelRunnerOutput,
    WorkerBase,
)

SIM_KEY = "mepic_sim"  # additional_config: {"profile": {...}, "token_id": int, "noise": {...}}
DTYPES = {2: torch.bfloat16, 4: torch.float32}
GiB = 1 << 30


class StepClock:
    """Turns a priced step into the step time the simulation advances by (``StepNoise``)."""

    def __init__(self, noise: StepNoise) -> None:
        self.noise = noise
        self.rng = np.random.default_rng(noise.seed)

    def __call__(self, priced_s: float) -> float:
        n = self.noise
        if n.sigma:
            return priced_s * n.scale * float(self.rng.lognormal(0.0, n.sigma))
        return priced_s * n.scale


def sim_settings(vllm_config: Any) -> tuple[DeviceProfile, ModelShape, int]:
    raw = (vllm_config.additional_config or {}).get(SIM_KEY)
    if raw is None:
        raise RuntimeError(
            "SimulatedWorker needs additional_config['mepic_sim'] (built by "
            "ascend_mepic.eval.sim.engine); it is not a worker for a real engine"
        )
    profile = DeviceProfile(**raw["profile"])
    model = vllm_config.model_config
    shape = ModelShape.from_hf_config(model.model, model.hf_text_config, profile.dtype_bytes)
    return profile, shape, int(raw.get("token_id", 0))


class SimulatedWorker(WorkerBase):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.pop("shared_worker_lock", None)
        super().__init__(*args, **kwargs)
        self.profile, self.shape, self.token_id = sim_settings(self.vllm_config)
        noise = (self.vllm_config.additional_config or {})[SIM_KEY].get("noise") or {}
        self.clock = StepClock(StepNoise(**noise))
        self.tracker = StepTracker(self.shape.layers)
        self.last_work = StepWork()
        self.last_step_s = 0.0
        self._store = None

    # ------------------------------------------------------------------ start-up
    def init_device(self) -> None:
        self.device = torch.device("cpu")

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        return None

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        spec = FullAttentionSpec(
            block_size=self.cache_config.block_size,
            num_kv_heads=self.shape.kv_heads,
            head_size=self.shape.head_dim,
            dtype=DTYPES[self.profile.dtype_bytes],
        )
        return {f"model.layers.{i}.self_attn.attn": spec for i in range(self.shape.layers)}

    def get_supported_kv_cache_layouts(self) -> list[str]:
        return ["NHD"]

    def determine_available_memory(self) -> int:
        """What vLLM's profiling run would leave for KV: the device's memory times the
        utilisation, less the weights and the profile's activation reserve."""
        p = self.profile
        budget = p.hbm_gib * GiB * p.memory_utilization
        free = int(budget - self.shape.weight_bytes - p.activation_reserve_gib * GiB)
        if free <= 0:
            raise ValueError(
                f"{self.shape.name} ({self.shape.weight_bytes / GiB:.1f} GiB of weights) leaves "
                f"no KV memory on {p.name} ({p.hbm_gib} GiB x {p.memory_utilization})"
            )
        return free

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        self.kv_cache_config = kv_cache_config

    def compile_or_warm_up_model(self) -> CompilationTimes:
        return CompilationTimes(0.0, 0.0)

    def get_model(self) -> Any:
        raise RuntimeError("the simulated worker has no model")

    # ------------------------------------------------------------------ steps
    def execute_model(self, scheduler_output: Any) -> ModelRunnerOutput:
        work, sampled = self.tracker.read(scheduler_output)
        self.last_work = work
        self.last_step_s = self.clock(step_seconds(work, self.shape, self.profile))
        self._save_to_host_store(scheduler_output)
        ids = list(scheduler_output.num_scheduled_tokens)
        chosen = set(sampled)
        return ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[self.token_id] if r in chosen else [] for r in ids],
        )

    def sample_tokens(self, grammar_output: Any) -> None:
        raise RuntimeError("execute_model returns the sampled tokens itself")

    def _save_to_host_store(self, scheduler_output: Any) -> None:
        """The chunks the real worker would save after this forward pass (``host_saves``)."""
        from ascend_mepic.tier.host_store import StoredChunk
        from ascend_mepic.vllm_integration import channel

        meta = scheduler_output.kv_connector_metadata
        if not isinstance(meta, channel.MepicStepMetadata) or not meta.plan.host_saves:
            return
        store = self._host_store()
        for save in meta.plan.host_saves:
            store.put(save.chunk_id, StoredChunk(torch.empty(0), save.num_tokens))

    def _host_store(self) -> Any:
        if self._store is None:
            from ascend_mepic.config import MepicConfig
            from ascend_mepic.tier.host_store import host_store

            config = MepicConfig.from_additional_config(self.vllm_config.additional_config)
            self._store = host_store(config.store_root(self.vllm_config))
        return self._store

    def shutdown(self) -> None:
        return None
