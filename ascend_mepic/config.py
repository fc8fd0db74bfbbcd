"""MEPIC's settings, read from vLLM's ``--additional-config '{"mepic": {...}}'``.

This follows the convention vllm-ascend uses for its own options. With no ``mepic`` key, or with
``"enabled": false``, nothing of vLLM changes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any

from ascend_mepic.markers import DEFAULT_BEGIN, DEFAULT_END
from ascend_mepic.policies import Policy, parse_policy
from ascend_mepic.segments import DEFAULT_PAD_TOKEN_ID


@dataclass(frozen=True)
class MepicConfig:
    enabled: bool = True
    # A PIC policy (see ascend_mepic/policies.py): "mepic" shares chunk KV and recomputes each
    # chunk's first block in context; "full" ignores segments (the accuracy reference); the
    # papers' baselines are "naive", "epic-K", "legolink-0", "cacheblend-R", "cachetune-R", and
    # "mepic-K" recomputes only K tokens of the first block.
    policy: str = "mepic"
    # CacheBlend's check layer: every chunk token is computed up to it, then only the selected.
    blend_check_layer: int = 1
    pad_token_id: int = DEFAULT_PAD_TOKEN_ID
    chunk_begin: str = DEFAULT_BEGIN
    chunk_end: str = DEFAULT_END
    # Share of the step's token budget kept for chunk compiles (extra sequences in the batch).
    compile_token_fraction: float = 0.5
    # Where the engine publishes MEPIC's metrics as JSON for the API server's /metrics and
    # /v1/mepic/stats (the engine core runs in another process); "" disables it.
    stats_file: str = ""
    # Where private-placement policies keep canonical chunk KV (host memory, shared by the
    # scheduler and worker processes); "" = a per-engine directory under /dev/shm.
    host_store_dir: str = ""

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
        parse_policy(config.policy)  # ValueError names the choices
        if config.blend_check_layer < 0:
            raise ValueError("blend_check_layer must be >= 0")
        return config

    def store_root(self, vllm_config: Any) -> str:
        from ascend_mepic.host_store import default_root

        return self.host_store_dir or str(default_root(vllm_config.instance_id))

    @property
    def parsed_policy(self) -> Policy:
        return dataclasses.replace(parse_policy(self.policy), check_layer=self.blend_check_layer)
