"""The KV manager's counters: written by the parts that admit and transfer, read by accounting.

A leaf of ``core/``: the parts increment it, ``KVAccounting`` reads it, so counts flow one way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ascend_mepic.core.plan import Residency

if TYPE_CHECKING:
    from ascend_mepic.core.request_intake import RequestState


@dataclass
class MepicCounters:
    chunk_hits: int = 0
    chunk_misses: int = 0
    tokens_reused: int = 0
    tokens_computed: int = 0
    requests_admitted: int = 0
    admissions_deferred: int = 0
    blocks_loaded: int = 0
    tier_loads_issued: int = 0
    tier_loads: int = 0
    tier_fallbacks: int = 0
    tier_decided_load: int = 0
    tier_decided_compute: int = 0
    tier_puts_issued: int = 0

    def count_admission(self, st: RequestState, residency: list[Residency]) -> None:
        """An admitted request: its chunk hits and misses, tokens computed and reused."""
        self.requests_admitted += 1
        self.chunk_hits += sum(r in (Residency.RESIDENT, Residency.IN_FLIGHT) for r in residency)
        self.chunk_misses += sum(r is Residency.COMPILE for r in residency)
        assert st.plan is not None
        self.tokens_computed += st.plan.num_compute_tokens
        self.tokens_reused += st.plan.num_reused_tokens
