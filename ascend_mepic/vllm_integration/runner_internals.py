"""The vLLM model-runner internals MEPIC's runner touches (vLLM 0.30.0), each with why.

MEPIC's runners subclass vLLM's (``--worker-cls`` installs them). After vLLM prepares a step's
inputs, ``MepicRunnerMixin._place_tokens`` rewrites, for MEPIC sequences only, the positions
(``runner.positions``) and the KV slot mapping (``input_batch.block_table[0].slot_mapping``),
reading ``query_start_loc`` and the block table: vLLM derives both from token indices, and a
MEPIC sequence's tokens sit at padded indices with logical positions. The overridden methods are
``_update_states`` (take the step plan), ``_prepare_inputs`` (place tokens), ``execute_model``
(saves after the forward) and ``load_model`` (CacheBlend's layer gates); their 0.30.0 signatures
are the ones used here.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ascend_mepic.core.plan import StepPlanError

# Handed to the builders at the start of a real step, replaced by the step's tables once the
# runner placed its tokens; a builder that still sees it refuses to build.
STEP_NOT_PLACED = object()


def mepic_builders(runner: Any) -> list[Any]:
    """The runner's attention metadata builders that are MEPIC's.

    Why: vLLM's builders see only ``CommonAttentionMetadata`` (no request identities); the
    per-step position tables reach them from the runner that owns them (``runner.attn_groups``,
    vLLM 0.30.0), not through process globals.
    """
    found = []
    for groups in getattr(runner, "attn_groups", ()):
        for group in groups:
            for builder in group.metadata_builders:
                if hasattr(builder, "set_step_inputs"):
                    found.append(builder)
    return found


def hand_step_tables(runner: Any, inputs: Any) -> None:
    """Give ``inputs`` (a ``worker.step.PlacedStep``, ``STEP_NOT_PLACED`` or None) to every
    MEPIC builder of ``runner``."""
    builders = mepic_builders(runner)
    if inputs is not None and inputs is not STEP_NOT_PLACED and not builders:
        raise StepPlanError(
            "MEPIC placed a step but the model has no MEPIC attention layers: the attention "
            "backend was not registered before the model was built"
        )
    for builder in builders:
        builder.set_step_inputs(inputs)


def check_block_table(table: Any, block_size: int) -> None:
    """MEPIC addresses KV by manager block; refuse vLLM 0.30.0's kernel-block split.

    Why: if the attention backend's kernel block size differs from the KV manager's, vLLM
    0.30.0's ``BlockTable`` stores kernel block ids (more than one per KV block) and MEPIC's
    slot arithmetic would address the wrong slots.
    """
    # vLLM's BlockTable names the split ``blocks_per_kv_block``; vllm-ascend 0.30.0rc2's own
    # BlockTable ``blocks_per_phys_block`` (its ``block_size`` is then the kernel block size).
    split = getattr(table, "blocks_per_kv_block", None)
    if split is None:
        split = getattr(table, "blocks_per_phys_block", 1)
    if split != 1 or getattr(table, "block_size", block_size) != block_size:
        raise StepPlanError(
            f"vLLM split the KV block size {block_size} into kernel blocks ({split} per block); "
            "MEPIC needs the attention backend to accept the KV block size itself"
        )


def widen_block_table(table: Any, block_size: int, width: int) -> None:
    """Give every row of a (still empty) worker block table ``width`` entries.

    Why: vLLM 0.30.0's ``BlockTable`` and vllm-ascend 0.30.0rc2's each size a row for
    ``max_model_len`` tokens (``KVCacheSpec.max_num_blocks_per_req``), and MEPIC's table lists
    more entries than its tokens fill (``core.request_limits``). No hook sizes the row: the spec
    must stay vLLM's ``FullAttentionSpec`` (its KV manager and allocation key on the type), so the
    runner replaces the row buffer right after the input batch is built, before any request has
    a row. Both classes keep the width in ``max_num_blocks_per_req`` (the stride of their slot
    mapping; with no kernel-block split, ``check_block_table``, both count KV blocks) and the rows
    in ``block_table``, a ``CpuGpuBuffer`` made by ``_make_buffer``.
    """
    check_block_table(table, block_size)
    old = table.block_table
    rows, cols = old.np.shape
    if cols >= width:
        return
    if table.num_blocks_per_row.any():
        raise StepPlanError("MEPIC can widen a block table only before it holds rows")
    new = table._make_buffer(rows, width, dtype=old.cpu.dtype)
    if old.gpu is old.cpu:  # vLLM's CPU runner aliases the device copy to the host one
        new.gpu = new.cpu
    table.block_table = new
    table.max_num_blocks_per_req = width


def step_token_inputs(
    runner: Any, num_tokens: int
) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    """The step's inputs vLLM prepared that MEPIC's placement reads: the batch's request ids,
    ``query_start_loc`` (host), the token positions vLLM derived from token indices (int64, host)
    and the block table rows (host).

    Why: vLLM 0.30.0 keeps them on the runner (``input_batch``, ``query_start_loc``,
    ``positions``) and in ``input_batch.block_table[0]``; no hook hands them to a plugin.
    """
    num_reqs = runner.input_batch.num_reqs
    table = runner.input_batch.block_table[0]
    check_block_table(table, runner.mepic_block_size)
    return (
        runner.input_batch.req_ids[:num_reqs],
        runner.query_start_loc.np[: num_reqs + 1],
        runner.positions[:num_tokens].cpu().numpy().astype(np.int64),
        table.block_table.np,
    )


def rewrite_positions_and_slots(
    runner: Any, num_tokens: int, positions: np.ndarray, slots: np.ndarray, mapped: np.ndarray
) -> None:
    """Write MEPIC's logical positions (all tokens) and KV slots (the ``mapped`` tokens) into
    the runner's inputs, after ``_prepare_inputs`` filled them and before the forward reads them.

    Why: the model reads ``runner.positions`` and the KV write reads the slot mapping
    (``input_batch.block_table[0].slot_mapping``, device side) in vLLM 0.30.0 and vllm-ascend
    0.30.0rc2; a MEPIC sequence's tokens sit at padded indices with logical positions, which
    vLLM cannot derive from token indices.
    """
    device = runner.positions.device
    runner.positions[:num_tokens] = torch.from_numpy(positions).to(device)
    slot_mapping = runner.input_batch.block_table[0].slot_mapping.gpu
    if mapped.all():
        slot_mapping[:num_tokens] = torch.from_numpy(slots).to(slot_mapping.device)
    else:
        rows = np.flatnonzero(mapped)
        slot_mapping[torch.from_numpy(rows).to(slot_mapping.device)] = torch.from_numpy(
            slots[rows]
        ).to(slot_mapping.device)


def fix_cpu_rejection_kernels() -> list[str]:
    """Point vLLM 0.30.0's rejection-sampling dispatchers at its own CPU kernels.

    Why: without Triton, ``CPUModelRunner._postprocess_triton`` rebinds the module names
    ``rejection_greedy_sample_kernel`` (and the three others) in ``vllm.v1.sample.
    rejection_sampler`` to its C++ kernels, but the sampler calls them through dispatchers
    (``_rejection_greedy_sample`` ...) that captured the Triton placeholders at import, so every
    verification step of speculative decoding raised ``TypeError: Cannot inspect kernel
    parameters``, MEPIC on or off. Rebinding each dispatcher's ``kernel`` fixes it; the C++
    kernels take the dispatchers' argument names except ``expand``'s (``input_val``), adapted
    here. Returns the dispatchers rebound (none where Triton is present)."""
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        return []
    import vllm.utils.cpu_triton_utils as cpu_kernels
    import vllm.v1.sample.rejection_sampler as sampler

    def expand(output, input, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: A002, N803
        return cpu_kernels.expand_kernel.func(
            output, input, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS
        )

    kernels = {
        "_rejection_greedy_sample": cpu_kernels.rejection_greedy_sample_kernel,
        "_rejection_random_sample": cpu_kernels.rejection_random_sample_kernel,
        "_sample_recovered_tokens": cpu_kernels.sample_recovered_tokens_kernel,
        "_expand": type(cpu_kernels.expand_kernel)(expand),
    }
    fixed = []
    for name, kernel in kernels.items():
        dispatcher = getattr(sampler, name, None)
        if dispatcher is not None and hasattr(dispatcher, "kernel"):
            dispatcher.kernel = kernel
            dispatcher.__dict__.pop("_kernel_arg_names", None)  # a cached_property
            fixed.append(name)
    return fixed


def fix_cpu_drafting_kernels() -> list[str]:
    """Point vLLM 0.30.0's drafter step dispatcher at its own CPU kernel (draft models).

    Why: as for the rejection sampler (``fix_cpu_rejection_kernels``), ``CPUModelRunner.
    _postprocess_triton`` rebinds the module name ``eagle_step_slot_mapping_metadata_kernel``
    in ``vllm.v1.spec_decode.utils`` but not the dispatcher that calls it,
    ``_eagle_step_slot_mapping_metadata``, which every draft after a proposer's first (more
    than one speculative token) goes through: it still held the Triton placeholder. The C++
    kernel names the block table's stride ``stride`` and takes no ``input_batch_size`` (the
    CPU runner never pads the drafter's batch), adapted here. Returns the dispatchers rebound
    (none where Triton is present)."""
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        return []
    import vllm.utils.cpu_triton_utils as cpu_kernels
    import vllm.v1.spec_decode.utils as spec_utils

    def eagle_step(
        positions, block_table, block_table_stride, seq_lens, out_clamped_positions,
        out_slot_mapping, block_size, max_model_len, n_blocks_per_req, PAD_ID,  # noqa: N803
        batch_size=None, input_batch_size=None,
    ):  # fmt: skip
        return cpu_kernels.eagle_step_slot_mapping_metadata_kernel.func(
            positions, block_table, block_table_stride, seq_lens, out_clamped_positions,
            out_slot_mapping, block_size, max_model_len, n_blocks_per_req, PAD_ID, batch_size,
        )  # fmt: skip

    dispatcher = getattr(spec_utils, "_eagle_step_slot_mapping_metadata", None)
    if dispatcher is None or not hasattr(dispatcher, "kernel"):
        return []
    dispatcher.kernel = type(cpu_kernels.eagle_step_slot_mapping_metadata_kernel)(eagle_step)
    dispatcher.__dict__.pop("_kernel_arg_names", None)  # a cached_property
    return ["_eagle_step_slot_mapping_metadata"]


def quiet_numba_threads() -> None:
    """Run vLLM's n-gram drafter (numba, ``prange``) on numba's own ``workqueue`` threads.

    Why: with numba's default threading layer the drafter's thread pool competed with torch's
    OpenMP threads on the CPU: every forward pass after the first draft ran 15-20x slower (a
    warm 7-token step of SmolLM2-135M on 2 cores: 2.0-2.9 s against 0.11-0.16 s without
    speculation; 0.10-0.14 s with ``workqueue`` or ``NUMBA_NUM_THREADS=1``). The drafter uses one
    thread below its token threshold anyway. Takes effect only before numba launches its pool;
    a user's ``NUMBA_THREADING_LAYER`` wins."""
    import os

    if "NUMBA_THREADING_LAYER" in os.environ:
        return
    import numba

    numba.config.THREADING_LAYER = "workqueue"
