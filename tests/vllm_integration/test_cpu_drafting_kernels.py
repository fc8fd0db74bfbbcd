"""vLLM 0.30.0's drafter step on CPU without Triton (``runner_internals.fix_cpu_drafting_kernels``).

Every draft after a draft model's first goes through ``_eagle_step_slot_mapping_metadata``,
whose dispatcher kept the Triton placeholder after vLLM's CPU runner rebound the module name:
it raised ``TypeError`` until MEPIC's CPU runner rebound the dispatcher to vLLM's C++ kernel.
"""

from __future__ import annotations

import pytest
import torch

from ascend_mepic.vllm_integration.runner_internals import fix_cpu_drafting_kernels


def test_the_drafter_step_runs_on_vllms_cpu_kernel():
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON or current_platform.device_type != "cpu":
        pytest.skip("Triton present or not vLLM's CPU build: nothing to rebind")
    current_platform.import_kernels()  # vLLM's C++ ops (torch.ops._C), as a CPU worker loads them
    import vllm.v1.spec_decode.utils as spec_utils

    assert fix_cpu_drafting_kernels() == ["_eagle_step_slot_mapping_metadata"]
    positions = torch.tensor([5, 9], dtype=torch.int64)
    table = torch.tensor([[3, 4], [6, 7]], dtype=torch.int32)
    seq_lens = torch.tensor([6, 10], dtype=torch.int32)
    out_positions = torch.zeros(2, dtype=torch.int64)
    out_slots = torch.zeros(2, dtype=torch.int64)
    spec_utils.eagle_step_update_slot_mapping_and_metadata(
        positions, table, seq_lens, 8, 64, out_positions, out_slots
    )
    assert out_positions.tolist() == [6, 10]
    assert out_slots.tolist() == [3 * 8 + 6, 7 * 8 + 2]  # block table[pos // 8] * 8 + pos % 8
    assert seq_lens.tolist() == [7, 11]
