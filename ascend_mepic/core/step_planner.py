"""The step plan: what the workers must do in one step beyond vLLM's own scheduler output.

``MepicKVCacheManager.take_step_plan`` asks this part once per step. It reads what the other
parts queued during the step's scheduling (the compile room's compiles, the tier's loads, the
admission's host loads and chunk moves) and the placements of the step's new requests, and turns
them into one ``StepPlan`` for the workers and the extra sequences the scheduler adds to the
step. Nothing here allocates: the blocks were taken when the work was queued.
"""

from __future__ import annotations

from collections.abc import Iterable

from ascend_mepic.core.admission import Admission
from ascend_mepic.core.chunk_transfers import TierTransfers
from ascend_mepic.core.plan import ChunkSave, ExtraSequence, SequencePlacement, StepPlan
from ascend_mepic.core.request_intake import RequestState
from ascend_mepic.core.step_room import StepRoom


class StepPlanner:
    """Builds each step's ``StepPlan`` from the parts' queues (one reader of each queue)."""

    def __init__(
        self,
        room: StepRoom,
        admission: Admission,
        tier_transfers: TierTransfers,
        states: dict[str, RequestState],
        dummy_token_id: int,
    ) -> None:
        self.room = room
        self.admission = admission
        self.tier_transfers = tier_transfers
        self.states = states
        self.dummy_token_id = dummy_token_id

    def take(
        self, step: int, new_request_ids: Iterable[str]
    ) -> tuple[StepPlan, list[ExtraSequence]]:
        """This step's plan for the workers and its extra sequences, taken once.

        The plan places the new (and resumed) tracked requests and this step's extra sequences:
        each chunk compile (the chunk alone from position 0, its private tokens in scratch
        blocks, its canonical tokens where the chunk arena placed them) and each tier load (one
        dummy token whose blocks the worker fills before the forward). It carries the host loads,
        the host-store saves and tier puts of the compiles, and the chunk moves (run first).
        """
        placements: dict[str, SequencePlacement] = {}
        for request_id in new_request_ids:
            st = self.states.get(request_id)
            if st is not None and st.placement is not None:
                placements[request_id] = st.placement
        extra: list[ExtraSequence] = []
        tier_loads = tuple(self.tier_transfers.take_step_loads())
        for load in tier_loads:
            extra.append(
                ExtraSequence(load.io_id, (self.dummy_token_id,), (load.scratch_block_id,))
            )
        host_saves: list[ChunkSave] = []
        tier_puts: list[ChunkSave] = []
        for request_id, compile_ in self.room.take_compiles():
            seq_id = f"mepic-compile-{compile_.chunk_id[:16]}-{request_id}"
            tokens = compile_.sequence_tokens
            placements[seq_id] = SequencePlacement(compile_.layout, len(tokens), compile=True)
            if compile_.store_blocks:
                blocks = compile_.block_ids[-compile_.store_blocks :]
                host_saves.append(
                    ChunkSave(
                        compile_.chunk_id, blocks, len(compile_.token_ids), compile_.store_scores
                    )
                )
            elif compile_.packing is not None and self.tier_transfers.wants_offload(
                compile_.chunk_id
            ):
                tier_puts.append(
                    ChunkSave(
                        compile_.chunk_id,
                        compile_.canonical_block_ids,
                        compile_.num_canonical,
                        offset=compile_.packing[1],
                    )
                )
            extra.append(ExtraSequence(seq_id, tokens, tuple(compile_.block_ids)))
        plan = StepPlan(
            step=step,
            placements=placements,
            host_loads=tuple(self.admission.take_host_loads()),
            host_saves=tuple(host_saves),
            tier_puts=tuple(tier_puts),
            tier_loads=tier_loads,
            chunk_moves=tuple(self.admission.take_moves()),
        )
        return plan, extra
