"""MEPIC's settings, read from vLLM's ``--additional-config '{"mepic": {...}}'``.

This follows the convention vllm-ascend uses for its own options. With no ``mepic`` key, or with
``"enabled": false``, nothing of vLLM changes. The options are one pydantic model (as vLLM's own
configs are), validated once when the config is built and frozen after: an unknown key, a wrong
type (``"false"`` is not a bool) or an out-of-range value fails there, naming the field and what
it accepts. The server, ``mepic_llm_kwargs`` and the engine hook all build it. The option
table is generated from the fields below (``scripts/mepic_options.py``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Annotated, Any, Literal

from pydantic import Field, Strict, field_validator, model_validator
from pydantic.dataclasses import dataclass

from ascend_mepic.core.markers import DEFAULT_BEGIN, DEFAULT_END
from ascend_mepic.core.options import OPTIONS, build
from ascend_mepic.core.policies import (
    DEFAULT_ANCHOR_MAX_TOKENS,
    POLICY_NAMES,
    Placement,
    Policy,
    parse_policy,
)
from ascend_mepic.core.request_limits import DEFAULT_MAX_CHUNKS
from ascend_mepic.core.segments import DEFAULT_PAD_TOKEN_ID
from ascend_mepic.tier.index import TierConfig

# ``ascend-mepic serve``'s own stats file (one per server) reaches its engine processes here, not
# in ``additional_config``: vLLM hashes ``additional_config`` into the key of its compile cache,
# so a fresh path there made every server start miss that cache and compile the model again.
STATS_FILE_ENV = "ASCEND_MEPIC_STATS_FILE"


@dataclass(frozen=True, config=OPTIONS)
class MepicConfig:
    enabled: Annotated[bool, Strict(), Field(description="MEPIC on for this engine")] = True
    policy: Annotated[
        str,
        Strict(),
        Field(
            description=(
                "the PIC policy: `mepic` shares chunk KV and recomputes each chunk's first 16 "
                "tokens in context (`mepic-K`: the first K; `mepic-block`: the paper's first "
                "block); `full` ignores segments (the accuracy reference); the papers' "
                "baselines are `naive`, `epic-K`, `legolink-0`, `cacheblend-R`, `cachetune-R`"
            ),
            examples=list(POLICY_NAMES),
        ),
    ] = "mepic"
    blend_check_layer: Annotated[
        int,
        Strict(),
        Field(
            ge=0,
            description=(
                "CacheBlend's check layer: every chunk token is computed up to it, then only "
                "the selected ones"
            ),
        ),
    ] = 1
    chunk_anchor: Annotated[
        Literal["first", "none", "prefix"],
        Field(
            description=(
                "shared-placement policies: `first` compiles every new chunk after the prompt "
                "before the first chunk of the engine's first request that has one (its KV not "
                "stored with the chunk): one copy per document whatever precedes it; `prefix` "
                "after each request's own (the chunk's identity includes it, so only requests "
                "with that prefix share it); `none` alone from position 0"
            )
        ),
    ] = "first"
    chunk_anchor_max_tokens: Annotated[
        int,
        Strict(),
        Field(
            ge=1,
            description=(
                "the anchor is at most this many leading tokens of that prompt (every compile "
                "recomputes them)"
            ),
        ),
    ] = DEFAULT_ANCHOR_MAX_TOKENS
    pad_token_id: Annotated[
        int, Strict(), Field(ge=0, description="the token that fills a chunk's last block")
    ] = DEFAULT_PAD_TOKEN_ID
    chunk_begin: Annotated[
        str, Strict(), Field(min_length=1, description="marker opening a chunk")
    ] = DEFAULT_BEGIN
    chunk_end: Annotated[
        str, Strict(), Field(min_length=1, description="marker closing a chunk")
    ] = DEFAULT_END
    compile_token_fraction: Annotated[
        float,
        Strict(),
        Field(
            gt=0,
            le=1,
            description=(
                "the most of a step's token budget chunk compiles and tier loads may take; "
                "nothing is set aside, and a request whose new chunks exceed it is refused"
            ),
        ),
    ] = 1.0
    stats_file: Annotated[
        str,
        Strict(),
        Field(
            description=(
                'where the engine publishes MEPIC\'s metrics as JSON for the API server; `""` '
                "disables it (default: `$ASCEND_MEPIC_STATS_FILE`, set by `ascend-mepic serve`)"
            )
        ),
    ] = ""
    host_store_dir: Annotated[
        str,
        Strict(),
        Field(
            description=(
                "where private-placement policies keep canonical chunk KV (default: a "
                "per-engine directory under /dev/shm)"
            )
        ),
    ] = ""
    tier: Annotated[
        TierConfig,
        Field(
            description=(
                'the LMCache chunk tier, e.g. `{"cpu_gib": 1, "disk": "/var/cache/mepic"}`'
                " (its options below); absent or `{}`: off"
            )
        ),
    ] = dataclasses.field(default_factory=TierConfig)
    max_chunks_per_request: Annotated[
        int,
        Strict(),
        Field(
            ge=1,
            description=(
                "chunks one request may have; sizes each request's block-table row (three "
                "entries per chunk); a request with more is refused"
            ),
        ),
    ] = DEFAULT_MAX_CHUNKS
    pinned_kv_fraction: Annotated[
        float,
        Strict(),
        Field(
            gt=0,
            le=1,
            description=(
                "the most of the KV pool's usable blocks that chunks pinned through "
                "`POST /v1/chunks` may hold, every tenant together; a registration past it gets "
                "HTTP 429, so other requests always keep the rest of the pool"
            ),
        ),
    ] = 0.5
    max_pinned_blocks_per_salt: Annotated[
        int,
        Strict(),
        Field(
            ge=0,
            description=(
                "the most KV blocks one `cache_salt`'s pinned chunks may hold (requests without "
                "a salt count as one tenant); a registration past it gets HTTP 429; `0`: only "
                "`pinned_kv_fraction` applies"
            ),
        ),
    ] = 0

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        parse_policy(value)  # its ValueError names the choices
        return value

    @field_validator("tier", mode="before")
    @classmethod
    def _tier(cls, value: Any) -> Any:
        if isinstance(value, dict) and value:
            return {"enabled": True, **value}  # validated by TierConfig, errors at tier.<key>
        return TierConfig() if not value else value

    @model_validator(mode="after")
    def _tier_holds_shared_chunks(self) -> MepicConfig:
        policy = self.parsed_policy
        if self.tier.enabled and (policy.placement is not Placement.SHARED or policy.loads_kv):
            raise ValueError(
                f"the LMCache tier holds shared chunk KV (policies mepic and naive); policy "
                f"{self.policy!r} keeps its chunks in the host store"
            )
        return self

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> MepicConfig:
        """The ``mepic`` object of ``additional_config``, validated (pydantic's errors)."""
        if not isinstance(options, dict):
            raise ValueError(f'additional_config["mepic"] must be an object, got {options!r}')
        config = build(cls, options)
        # The anchor's default applies where chunk KV is shared; set for another policy, it is
        # a mistake worth naming (it would do nothing).
        anchor = options.get("chunk_anchor", "none")
        if anchor != "none" and config.parsed_policy.placement is not Placement.SHARED:
            raise ValueError(
                f"MEPIC option 'chunk_anchor': {anchor!r} applies to shared-placement policies "
                f"(mepic, mepic-K, mepic-block, naive); policy {config.policy!r} does not share "
                "chunk KV"
            )
        if "stats_file" not in options and os.environ.get(STATS_FILE_ENV):
            config = dataclasses.replace(config, stats_file=os.environ[STATS_FILE_ENV])
        return config

    @classmethod
    def from_additional_config(cls, additional: dict[str, Any] | None) -> MepicConfig:
        raw = (additional or {}).get("mepic")
        if raw is None:
            return cls(enabled=False)
        return cls.from_options(raw)

    def store_root(self, vllm_config: Any) -> str:
        from ascend_mepic.tier.host_store import default_root

        return self.host_store_dir or str(default_root(vllm_config.instance_id))

    @property
    def parsed_policy(self) -> Policy:
        return dataclasses.replace(
            parse_policy(self.policy),
            check_layer=self.blend_check_layer,
            anchor=self.chunk_anchor,
            anchor_max_tokens=self.chunk_anchor_max_tokens,
        )
