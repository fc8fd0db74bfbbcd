"""What the scheduler sets on the KV manager after building it, shared by the manager's parts.

``MepicScheduler`` builds ``MepicKVCacheManager`` with vLLM's own arguments, then sets the policy,
the dummy token, the host store and the tier on it. The manager's parts (intake, hit lookup,
admission, transfers, accounting) all read this one object, so a value set later is seen by all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ascend_mepic.core.policies import Policy, parse_policy
from ascend_mepic.core.request_limits import DEFAULT_MAX_CHUNKS
from ascend_mepic.tier.host_store import HostChunkStore
from ascend_mepic.tier.index import TierIndex


@dataclass
class KVSettings:
    policy: Policy = field(default_factory=lambda: parse_policy("mepic"))
    dummy_token_id: int = 0  # LegoLink-0's dummy token (the model's BOS)
    store: HostChunkStore | None = None  # set by the scheduler for loading policies
    tier: TierIndex | None = None  # set by the scheduler when the tier is configured
    max_chunks: int = DEFAULT_MAX_CHUNKS  # chunks per request (``core.request_limits``)
