"""What the KV manager is built with beyond vLLM's arguments: one frozen value, made once.

``MepicScheduler`` makes it from MEPIC's configuration before it builds ``MepicKVCacheManager``
(kvsim and the unit tests use the defaults). The manager hands the same object to each of its
parts (intake, hit lookup, admission, transfers, accounting), and nothing changes it afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ascend_mepic.core.policies import Policy, parse_policy
from ascend_mepic.core.request_limits import DEFAULT_MAX_CHUNKS
from ascend_mepic.tier.host_store import HostChunkStore
from ascend_mepic.tier.index import TierIndex


@dataclass(frozen=True)
class StepBudgets:
    """The runner's per-step batch and the share of it one step's compiles may take
    (``StepRoom.set_budgets``); None in ``KVSettings`` means unbounded (kvsim)."""

    tokens: int
    seqs: int
    compile_token_cap: int
    whole_prefills: bool = False
    compiles: bool = True  # the policy runs chunk compiles or loads (not ``full``/``prefix``)


@dataclass(frozen=True)
class KVSettings:
    policy: Policy = field(default_factory=lambda: parse_policy("mepic"))
    dummy_token_id: int = 0  # LegoLink-0's dummy token (the model's BOS)
    store: HostChunkStore | None = None  # the host chunk store, for loading policies
    tier: TierIndex | None = None  # the off-device tier's index, when it is configured
    max_chunks: int = DEFAULT_MAX_CHUNKS  # chunks per request (``core.request_limits``)
    budgets: StepBudgets | None = None
    pinned_fraction: float = 0.5  # of the usable pool, all pinned chunks together
    pinned_per_salt: int = 0  # blocks one cache salt's pinned chunks may hold; 0: no own limit
