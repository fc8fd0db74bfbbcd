"""MEPIC's settings, read from vLLM's ``--additional-config '{"mepic": {...}}'``.

This follows the convention vllm-ascend uses for its own options. With no ``mepic`` key, or with
``"enabled": false``, nothing of vLLM changes.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field, fields
from typing import Any

from ascend_mepic.core.markers import DEFAULT_BEGIN, DEFAULT_END
from ascend_mepic.core.policies import Placement, Policy, parse_policy
from ascend_mepic.core.request_limits import DEFAULT_MAX_CHUNKS
from ascend_mepic.core.segments import DEFAULT_PAD_TOKEN_ID
from ascend_mepic.tier.index import TierConfig

# ``ascend-mepic serve``'s own stats file (one per server) reaches its engine processes here, not
# in ``additional_config``: vLLM hashes ``additional_config`` into the key of its compile cache,
# so a fresh path there made every server start miss that cache and compile the model again.
STATS_FILE_ENV = "ASCEND_MEPIC_STATS_FILE"


@dataclass(frozen=True)
class MepicConfig:
    enabled: bool = True
    # A PIC policy (see ascend_mepic/core/policies.py): "mepic" shares chunk KV and recomputes
    # each chunk's first 16 tokens in context ("mepic-K": the first K; "mepic-block": the paper's
    # first block); "full" ignores segments (the accuracy reference); the papers' baselines are
    # "naive", "epic-K", "legolink-0", "cacheblend-R", "cachetune-R".
    policy: str = "mepic"
    # CacheBlend's check layer: every chunk token is computed up to it, then only the selected.
    blend_check_layer: int = 1
    pad_token_id: int = DEFAULT_PAD_TOKEN_ID
    chunk_begin: str = DEFAULT_BEGIN
    chunk_end: str = DEFAULT_END
    # The most of a step's token budget (max_num_batched_tokens) that chunk compiles and tier
    # loads may take, in (0, 1]. Nothing is set aside: compiles use what the step's requests
    # leave, only in steps that issue them; a lower cap bounds how much a burst of new chunks
    # can slow the step's decodes, and requests whose new chunks exceed it are rejected.
    compile_token_fraction: float = 1.0
    # Where the engine publishes MEPIC's metrics as JSON for the API server's /metrics and
    # /v1/mepic/stats (the engine core runs in another process); "" disables it. Unset, it is
    # $ASCEND_MEPIC_STATS_FILE (set by ``ascend-mepic serve``), if any.
    stats_file: str = ""
    # Where private-placement policies keep canonical chunk KV (host memory, shared by the
    # scheduler and worker processes); "" = a per-engine directory under /dev/shm.
    host_store_dir: str = ""
    # The off-device chunk tier in LMCache (see ascend_mepic/tier/index.py), e.g.
    # {"cpu_gib": 1, "disk": "/var/cache/mepic"} or {"remote": "redis://10.0.0.5:6379"}.
    tier: dict[str, Any] = field(default_factory=dict)
    # Chunks one request may have. It sizes each request's block-table row (a chunk can add
    # three entries beyond its tokens: ``core.request_limits``); a request with more is refused.
    max_chunks_per_request: int = DEFAULT_MAX_CHUNKS

    @classmethod
    def from_additional_config(cls, additional: dict[str, Any] | None) -> MepicConfig:
        raw = (additional or {}).get("mepic")
        if raw is None:
            return cls(enabled=False)
        if not isinstance(raw, dict):
            raise ValueError(f'additional_config["mepic"] must be an object, got {raw!r}')
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown MEPIC option(s) {unknown}; known: {sorted(known)}")
        config = cls(**raw)
        if "stats_file" not in raw and os.environ.get(STATS_FILE_ENV):
            config = dataclasses.replace(config, stats_file=os.environ[STATS_FILE_ENV])
        parse_policy(config.policy)  # ValueError names the choices
        if type(config.max_chunks_per_request) is not int or config.max_chunks_per_request < 1:
            raise ValueError(
                f"max_chunks_per_request must be a positive integer, got "
                f"{config.max_chunks_per_request!r}"
            )
        if config.blend_check_layer < 0:
            raise ValueError("blend_check_layer must be >= 0")
        policy = config.parsed_policy
        if config.tier_config.enabled and (
            policy.placement is not Placement.SHARED or policy.loads_kv
        ):
            raise ValueError(
                f"the LMCache tier holds shared chunk KV (policies mepic and naive); policy "
                f"{config.policy!r} keeps its chunks in the host store"
            )
        return config

    @property
    def tier_config(self) -> TierConfig:
        return TierConfig.parse(self.tier)

    def store_root(self, vllm_config: Any) -> str:
        from ascend_mepic.tier.host_store import default_root

        return self.host_store_dir or str(default_root(vllm_config.instance_id))

    @property
    def parsed_policy(self) -> Policy:
        return dataclasses.replace(parse_policy(self.policy), check_layer=self.blend_check_layer)
