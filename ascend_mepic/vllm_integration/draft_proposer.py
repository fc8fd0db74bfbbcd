"""vLLM 0.30.0's draft-model proposer, its drafter's KV slots and positions placed by MEPIC.

Why: vLLM's ``SpecDecodeBaseProposer`` (``vllm.v1.spec_decode.llm_base_proposer``) runs the
drafter over the target's scheduled tokens plus one per request (the token just sampled), then
one token per request for each further draft, and derives every drafter token's KV slot from
its position through the request's block table (``compute_new_slot_mapping`` in the first pass,
``eagle_step_update_slot_mapping_and_metadata`` in later ones): ``table[pos // B] * B +
pos % B``, which is right only where position = token index. A MEPIC sequence's token ``i``
sits at a padded index with a logical position, neither of them ``i``, and its table lists
shared chunk blocks; the positions vLLM hands the drafter are the logical positions MEPIC
wrote into the runner's inputs, so vLLM's slots would address the table by logical position.
With vLLM's proposer unchanged the first step failed before any drafter KV was written: the
drafter's MEPIC builders had no step tables and fell back to identity tables built from
``CommonAttentionMetadata.positions``, which the drafter's metadata does not carry
(``TypeError`` in ``MepicAttentionMetadataBuilder.build``; an earlier trial, before the CPU
drafter-step fix, ended in a segmentation fault).

``MepicDraftModelProposer`` keeps vLLM's drafting arithmetic in token indices (the target's
indices of the step, not its logical positions) and, at the two places vLLM turns indices
into slots, asks a ``DraftPlacer`` (the runner's, over its token maps) for the drafter batch's
padded slots, logical positions and step tables; the slots replace vLLM's (vLLM's padding
slots, rejected tokens', stay padding), the positions feed the drafter model, the tables go to
the drafter's MEPIC attention builders. The drafter's layers have caches of their own in the
same blocks (one KV cache group), so the drafter's pass over a step's chunk compiles writes
the drafter's canonical chunk KV into the chunk's shared blocks, where later requests' drafter
passes read it, as the target's do. Overridden (their 0.30.0 signatures): ``propose``,
``set_inputs_first_pass``, ``_update_positions_dependent_metadata``, ``_get_positions``.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch
from vllm.v1.spec_decode.draft_model import DraftModelProposer


class DraftPlacer(Protocol):
    """What the proposer needs from MEPIC's runner, per step."""

    def target_indices(self, num_tokens: int) -> torch.Tensor:
        """The target's token indices of the step's first ``num_tokens`` tokens (int64)."""

    def place(
        self, query_start_loc: np.ndarray, index: np.ndarray, block_table: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, Any]:
        """A drafter batch (rows as the step's, tokens numbered ``index``): per token its
        logical position and KV slot (< 0: write nowhere), and the step tables for the
        attention builders."""


def is_vllm_draft_model_proposer(drafter: Any) -> bool:
    """vLLM's own draft-model proposer (not EAGLE's, not an n-gram drafter, not ours)."""
    return type(drafter) is DraftModelProposer


def uses_draft_model(speculative_config: Any) -> bool:
    return speculative_config is not None and speculative_config.uses_draft_model()


def install_drafter(runner: Any, drafter: DraftModelProposer) -> None:
    """Make ``drafter`` the runner's proposer, before the model (and the drafter's) loads.

    Why: vLLM 0.30.0's ``GPUModelRunner.__init__`` builds its ``DraftModelProposer`` itself
    (``runner.drafter``) and offers no hook for another class; the runner's ``load_model``
    and ``initialize_kv_cache`` then load the drafter and build its attention groups
    through that attribute."""
    runner.drafter = drafter


class MepicDraftModelProposer(DraftModelProposer):
    """vLLM's draft-model proposer whose drafter batches are placed by ``placer``."""

    def __init__(self, vllm_config, device, runner, placer: DraftPlacer) -> None:
        super().__init__(vllm_config=vllm_config, device=device, runner=runner)
        if self.uses_mrope:
            raise ValueError("MEPIC's drafter placement does not take M-RoPE")
        self.placer = placer
        # The drafter model's positions (logical); ``self.positions`` keeps token indices,
        # which vLLM's drafting arithmetic (the bonus token, each further draft) runs on.
        self.logical_positions = torch.zeros_like(self.positions)

    def propose(self, *args, **kwargs) -> torch.Tensor:
        try:
            return super().propose(*args, **kwargs)
        finally:
            self._hand_tables(None)  # outside a drafter pass, its builders see no tables

    def set_inputs_first_pass(self, *args, **kwargs):
        """vLLM's first-pass inputs from the target's token indices (vLLM passes the target's
        positions, which MEPIC made logical), then MEPIC's slots for them."""
        kwargs["target_positions"] = self.placer.target_indices(len(kwargs["target_positions"]))
        num_tokens, sample_at, cad = super().set_inputs_first_pass(*args, **kwargs)
        self._place(cad, num_tokens)
        return num_tokens, sample_at, cad

    def _update_positions_dependent_metadata(
        self, positions, common_attn_metadata, batch_size, input_batch_size, block_size
    ):
        out = super()._update_positions_dependent_metadata(
            positions, common_attn_metadata, batch_size, input_batch_size, block_size
        )
        self._place(common_attn_metadata, batch_size)
        return out

    def _get_positions(self, num_tokens: int) -> torch.Tensor:
        return self.logical_positions[:num_tokens]

    def _place(self, cad, num_tokens: int) -> None:
        """Rewrite the batch's slots (in place: vLLM reads ``cad.slot_mapping`` again for the
        forward) and positions from the placer, and hand its tables to the builders."""
        index = self.positions[:num_tokens].cpu().numpy().astype(np.int64)
        positions, slots, tables = self.placer.place(
            cad.query_start_loc_cpu.numpy(), index, cad.block_table_tensor.cpu().numpy()
        )
        mapping = cad.slot_mapping[:num_tokens]
        vllm_slots = mapping.cpu().numpy()
        slots = np.where(vllm_slots < 0, vllm_slots, slots)  # vLLM's padding stays padding
        mapping.copy_(torch.from_numpy(slots.astype(np.int64)).to(mapping.device))
        self.logical_positions[:num_tokens] = torch.from_numpy(positions).to(self.device)
        self._hand_tables(tables)

    def _hand_tables(self, tables: Any) -> None:
        for group in self.draft_attn_groups:
            for builder in group.metadata_builders:
                if hasattr(builder, "set_step_inputs"):
                    builder.set_step_inputs(tables)
