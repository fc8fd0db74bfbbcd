"""Per-step MEPIC metadata cost for one decode step, on the host.

1. ``MepicRunnerMixin._place_tokens`` (positions, KV slots and the step's position tables for
   every sequence of the batch) on a stand-in runner holding only what that method reads, for
   decoding batches of requests with chunked, padded layouts at about 2k tokens of context (a
   64-token prompt, 4 chunks of 480 tokens, a 32-token question), optionally with a share of
   plain requests (no token map).
2. The torch reference attention's per-step plan (what it memoises on the step's metadata for
   every layer) for the same number of decoding sequences at 2k tokens: its first call on a
   step's metadata minus a later call (one layer's work).

Prints medians; asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time
import types

import numpy as np
import torch

from ascend_mepic.core.plan import SequencePlacement, StepPlan
from ascend_mepic.core.segments import Segment, build_layout
from ascend_mepic.entrypoints.streams import print_data_only
from ascend_mepic.eval.outputs import positive
from ascend_mepic.ops import PagedRopeMetadata, RopeSpec
from ascend_mepic.ops.reference import rope_paged_attention_reference
from ascend_mepic.worker.model_runner import MepicRunnerMixin

BLOCK_SIZE = 16
TABLE_WIDTH = 256  # block-table entries per request (4k tokens at block 16)


def placement(block_size: int) -> SequencePlacement:
    """A request's placement: prompt, 4 chunks of 480 tokens, question (about 2k tokens)."""
    segments = [Segment.prompt(range(64))]
    segments += [Segment.chunk(range(480)) for _ in range(4)]
    segments.append(Segment.prompt(range(32)))
    layout = build_layout(segments, block_size)
    return SequencePlacement(layout, len(layout.in_context_slots()))


class _Builder:
    def set_step_inputs(self, inputs) -> None:
        self.inputs = inputs


class StandInRunner(MepicRunnerMixin):
    """The attributes ``_place_tokens`` reads, shaped as vLLM 0.30.0's runner holds them."""

    def __init__(self, num_reqs: int, num_plain: int, block_size: int) -> None:
        self.mepic_block_size = block_size
        self.mepic_blend_layer = None
        self.device = torch.device("cpu")
        self._init_placements()
        req_ids = [f"r{i}" for i in range(num_reqs)]
        mepic = req_ids[num_plain:]
        where = placement(block_size)
        plan = StepPlan(step=0, placements={r: where for r in mepic})
        new = [
            types.SimpleNamespace(req_id=r, prompt_token_ids=range(where.num_in_context))
            for r in mepic
        ]
        self._take_placements(plan, new)
        max_tokens = 2 * num_reqs * 2048
        table = types.SimpleNamespace(
            block_size=block_size,
            blocks_per_kv_block=1,
            max_num_blocks_per_req=TABLE_WIDTH,
            block_table=types.SimpleNamespace(
                np=np.arange(num_reqs * TABLE_WIDTH, dtype=np.int32).reshape(num_reqs, -1)
            ),
            slot_mapping=types.SimpleNamespace(gpu=torch.zeros(max_tokens, dtype=torch.int64)),
        )
        self.input_batch = types.SimpleNamespace(
            num_reqs=num_reqs, req_ids=req_ids, block_table=[table]
        )
        self.query_start_loc = types.SimpleNamespace(np=np.zeros(max_tokens + 1, dtype=np.int32))
        self.positions = torch.zeros(max_tokens, dtype=torch.int64)
        self.attn_groups = [[types.SimpleNamespace(metadata_builders=[_Builder()])]]
        self.num_in_context = np.array(
            [2048] * num_plain + [where.num_in_context] * len(mepic), dtype=np.int64
        )

    def _init_placements(self) -> None:
        init = getattr(MepicRunnerMixin, "_init_placement_state", None)
        if init is not None:
            init(self)
        else:  # the per-sequence runner this benchmark was first measured on
            self._token_maps, self._blend = {}, {}

    def decode_step(self, step: int) -> int:
        """Set up vLLM's inputs of decode step ``step`` (one token per request)."""
        n = len(self.num_in_context)
        self.query_start_loc.np[: n + 1] = np.arange(n + 1)
        self.positions[:n] = torch.from_numpy(self.num_in_context + step)
        return n


def time_steps(runner: StandInRunner, steps: int) -> float:
    """Median seconds of ``_place_tokens`` over ``steps`` decode steps."""
    times = []
    for s in range(steps):
        num_tokens = runner.decode_step(s)
        t0 = time.perf_counter()
        runner._place_tokens(num_tokens)
        times.append(time.perf_counter() - t0)
    return positive(statistics.median(times), "_place_tokens per step (s)")


def reference_plan_seconds(num_seqs: int, context: int = 2048, repeats: int = 5) -> float:
    """Median per-step planning time of the torch reference for ``num_seqs`` decode queries
    over ``context`` keys each (all sequences read the same blocks: the plan, not the cache
    size, is measured)."""
    bs, heads, head = BLOCK_SIZE, 1, 64
    blocks = context // bs
    first = (torch.arange(blocks, dtype=torch.int32) * bs).expand(num_seqs, blocks).contiguous()
    last = torch.full((num_seqs,), context - 1, dtype=torch.int32)
    kv_cache = torch.randn(2, blocks, bs, heads, head)
    query = torch.randn(num_seqs, heads, head)
    rope = RopeSpec.from_cache(torch.randn(2 * context, head), True)
    times = []
    for _ in range(repeats):
        meta = PagedRopeMetadata(
            block_size=bs,
            query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32),
            query_positions=last,
            query_indices=last,
            block_tables=torch.arange(blocks, dtype=torch.int32).expand(num_seqs, -1),
            num_blocks=torch.full((num_seqs,), blocks, dtype=torch.int32),
            block_first_pos=first,
            block_valid_start=torch.zeros_like(first),
            block_valid_end=torch.full_like(first, bs),
            max_query_len=1,
            max_num_blocks=blocks,
        )
        t0 = time.perf_counter()
        rope_paged_attention_reference(query, kv_cache, meta, rope, 1.0)
        t1 = time.perf_counter()
        rope_paged_attention_reference(query, kv_cache, meta, rope, 1.0)
        t2 = time.perf_counter()
        times.append((t1 - t0) - (t2 - t1))
    # A difference of two timings: noise can make it zero or negative, which is no plan cost.
    what = f"reference attention's per-step plan, {num_seqs} sequences (first call - later call, s)"
    return positive(statistics.median(times), what)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    print_data_only()  # stdout: this script's data only; logs (vLLM's too) to stderr
    torch.set_num_threads(1)
    print("| decoding requests | plain among them | _place_tokens per step (ms) |")
    print("|---|---|---|")
    for n in args.requests:
        for plain in (0, n // 2):
            runner = StandInRunner(n, plain, BLOCK_SIZE)
            t = time_steps(runner, args.steps)
            print(f"| {n} | {plain} | {t * 1e3:.3f} |")
    print()
    print("| decoding sequences (2k context) | reference attention's per-step plan (ms) |")
    print("|---|---|")
    for n in args.requests:
        print(f"| {n} | {reference_plan_seconds(n) * 1e3:.1f} |")


if __name__ == "__main__":
    main()
