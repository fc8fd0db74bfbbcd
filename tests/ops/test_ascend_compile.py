"""The triton-ascend kernel through triton-ascend's own compiler (``ttir`` and ``ttadapter``).

The interpreter tests (``test_ascend_kernel.py``) run the kernels' Python and never compile it;
this compiles, for a 910B3 target, every launch the launcher plans (``plan_launches``) over the
configurations the worker can launch: head 64/80/96/128/256 with every tile choice
``choose_tiles`` makes for them, fp16/bf16/fp32, prefill (with its query-rotation kernel) and
split decode (with its combine kernel), NeoX and GPT-J rotation, GQA 1-8, cos/sin in float32
or the model's dtype, at vllm-ascend's block size 128. The set is a covering set of that product
(each feature combination below appears at least once), built once; identical compilations are
done once. The doctor's self-test launches are compiled too.

Needs triton-ascend (``make test-ascend`` runs it, without ``TRITON_INTERPRET``); skipped elsewhere.
Passing says only that these two stages accept the kernels: CANN's final stage
(``CANN_ONLY_CHECKS``) and the hardware are untested.
"""

from __future__ import annotations

import importlib.metadata
import itertools
import os
from dataclasses import dataclass

import pytest
import torch

try:
    importlib.metadata.distribution("triton-ascend")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("triton is not triton-ascend (run make test-ascend)", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip(
        "compiling needs TRITON_INTERPRET unset (scripts/test_ascend.sh runs this file so)",
        allow_module_level=True,
    )

import ascend_mepic.ops.triton_ascend as asc  # noqa: E402
from ascend_mepic.ops import RopeSpec, SequenceSpec, build_metadata  # noqa: E402
from ascend_mepic.ops.rope import default_cos_sin_cache  # noqa: E402
from tests.ops.ascend_compile import compile_stages, error_text, launch_key  # noqa: E402

HEADS = (64, 80, 96, 128, 256)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
GROUPS = tuple(range(1, 9))
BLOCK = 128  # vllm-ascend's kernel block size
NUM_KV_HEADS = 2
CORES = asc.DEFAULT_NPU_CORES


@dataclass(frozen=True)
class Config:
    head: int
    dtype: torch.dtype
    group: int
    decode: bool
    neox: bool = True
    cos_sin_fp32: bool = False

    def tiles(self) -> tuple[int, int]:
        cs = torch.float32 if self.cos_sin_fp32 else self.dtype
        dot_fp32 = self.dtype == torch.float32
        return asc.choose_tiles(self.head, self.group, BLOCK, self.dtype, self.dtype, cs,
                                self.decode, dot_fp32)  # fmt: skip

    def __str__(self) -> str:
        kind = "decode" if self.decode else "prefill"
        return (f"{kind}-h{self.head}-{str(self.dtype)[6:]}-gqa{self.group}-"
                f"{'neox' if self.neox else 'gptj'}-"
                f"cs{'32' if self.cos_sin_fp32 else 'model'}")  # fmt: skip


def _features(c: Config) -> list[tuple]:
    """What a covering set must contain at least once."""
    k = c.decode
    return [
        ("tiles", k, c.head, c.tiles()),  # every choose_tiles result per head
        ("gqa", k, c.group, c.dtype),
        ("form", k, c.head, c.neox),
        ("form-dtype", k, c.dtype, c.neox),
        ("cos-sin", k, c.head, c.cos_sin_fp32),
        ("cos-sin-dtype", k, c.dtype, c.cos_sin_fp32),
        ("rotation", k, c.group, c.neox),
        ("axes", k, c.neox, c.cos_sin_fp32),
    ]


def covering_configs() -> list[Config]:
    """Greedy set cover of the whole product: repeatedly keep the configuration that adds the
    most features not yet covered (deterministic: ties go to the earliest in product order)."""
    product = [
        Config(head, dtype, group, decode, neox, cs32)
        for decode, head, dtype, group, neox, cs32 in itertools.product(
            (False, True), HEADS, DTYPES, GROUPS, (True, False), (False, True)
        )
    ]
    features = {c: set(_features(c)) for c in product}
    missing = set().union(*features.values())
    kept = []
    while missing:
        best = max(product, key=lambda c: len(features[c] & missing))
        kept.append(best)
        missing -= features[best]
    return kept


def _batch(c: Config):
    """A small layout at block 128 that reaches every code path: a chunk front-padded in its
    block, a shared block at another position, scattered queries (prefill), or one query per
    sequence (decode)."""
    if c.decode:
        seqs = [SequenceSpec([1, 2], [0, 128], [0, 0], [128, 17], [BLOCK + 16], [144]),
                SequenceSpec([3, 1], [0, 20], [0, 96], [20, 128], [BLOCK + 127], [51])]  # fmt: skip
    else:
        seqs = [
            SequenceSpec([1, 2, 3], [0, 32, 96], [96, 64, 0], [128, 128, 40],
                         [BLOCK + 70, *range(2 * BLOCK, 2 * BLOCK + 40)], [38, *range(96, 136)]),
            SequenceSpec([4, 1], [0, 50], [0, 96], [50, 128], list(range(BLOCK + 96, 2 * BLOCK)),
                         list(range(50, 82))),
        ]  # fmt: skip
    meta = build_metadata(seqs, BLOCK)
    hkv, hq = NUM_KV_HEADS, NUM_KV_HEADS * c.group
    query = torch.zeros(meta.num_queries, hq, c.head, dtype=c.dtype)
    kv = torch.zeros(2, 5, BLOCK, hkv, c.head, dtype=c.dtype)
    cs = default_cos_sin_cache(c.head, 512).to(torch.float32 if c.cos_sin_fp32 else c.dtype)
    return query, kv, meta, RopeSpec.from_cache(cs, c.neox), c.head**-0.5


def planned(c: Config) -> list[asc.Launch]:
    query, kv, meta, rope, scale = _batch(c)
    plan = asc.plan_launches(
        query, kv, meta, rope, scale, kernel="decode" if c.decode else "prefill", cores=CORES,
        num_splits=2 if c.decode else None, half_dots=c.dtype != torch.float32,
    )  # fmt: skip
    return plan.launches


CONFIGS = covering_configs()
_compiled: dict[str, str | None] = {}  # launch key -> None (compiled) or the compiler's error


def compile_once(launch: asc.Launch) -> str | None:
    key = launch_key(launch.kernel, launch.args, launch.kwargs)
    if key not in _compiled:
        try:
            compile_stages(launch.kernel, launch.args, launch.kwargs)
            _compiled[key] = None
        except Exception as exc:  # the compiler's error, reported with its configuration
            _compiled[key] = error_text(exc)
    return _compiled[key]


def test_the_covering_set_spans_the_configuration_list():
    """Each axis value and every tile choice per head is in the set."""
    assert {c.head for c in CONFIGS} == set(HEADS)
    assert {c.dtype for c in CONFIGS} == set(DTYPES)
    assert {c.group for c in CONFIGS} == set(GROUPS)
    assert {(c.decode, c.neox, c.cos_sin_fp32) for c in CONFIGS} == set(
        itertools.product((False, True), repeat=3)
    )
    for decode, head, dtype, group in itertools.product((False, True), HEADS, DTYPES, GROUPS):
        tiles = Config(head, dtype, group, decode).tiles()
        assert any(c.decode == decode and c.head == head
                   and c.tiles() == tiles for c in CONFIGS)  # fmt: skip


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_kernel_compiles_through_ttir_and_ttadapter(config):
    launches = planned(config)
    names = {launch.kernel.fn.__name__ for launch in launches}
    want = (
        {"_decode_kernel", "combine_kernel"}
        if config.decode
        else {"_rope_q_kernel", "_prefill_kernel"}
    )
    assert names == want
    for launch in launches:
        err = compile_once(launch)
        assert err is None, f"{launch.kernel.fn.__name__} ({config}):\n{err[-3000:]}"


def test_doctor_self_test_launches_compile(monkeypatch):
    """`ascend-mepic doctor`'s self-test on a 910B launches these (its batch, fp16/bf16, heads
    64 and 128, the NPU's tile and dot choices): each compiles."""
    from ascend_mepic.entrypoints import doctor

    monkeypatch.setattr(asc, "INTERPRETED", False)  # the NPU's choices, as on a device
    for dtype in (torch.float16, torch.bfloat16):
        for head in doctor.SELF_TEST_HEADS:
            b = doctor.selftest_batch(head, dtype, "cpu")
            plan = asc.plan_launches(b["query"], b["kv_cache"], b["meta"], b["rope"], b["scale"],
                                     cores=CORES)  # fmt: skip
            assert plan.launches
            for launch in plan.launches:
                err = compile_once(launch)
                assert err is None, f"{launch.kernel.fn.__name__} (doctor, head {head}):\n{err}"
