"""The triton-ascend kernel through triton-ascend's own compiler (``ttir`` and ``ttadapter``),
then BiSheng IR's ``bishengir-compile`` to the final HIVM IR for Ascend910B3, with the
unified buffer (UB) and L1 each launch is planned to use.

The interpreter tests (``test_ascend_kernel.py``) run the kernels' Python and never compile it;
this compiles, for a 910B3 target, every launch the launcher plans (``plan_launches``) over the
configurations the worker can launch: head 64/80/96/128/256 with every tile choice
``choose_tiles`` makes for them, fp16/bf16/fp32, prefill (with its query-rotation kernel) and
split decode (with its combine kernel), NeoX and GPT-J rotation, GQA 1-8, cos/sin in float32
or the model's dtype, at vllm-ascend's block size 128. The set is a covering set of that product
(each feature combination below appears at least once), built once; identical compilations are
done once. The doctor's self-test launches are compiled too.

The HIVM stage (``tests/ops/ascend_hivm.py``) runs as triton-ascend 3.2.0's backend invokes
it; every distinct launch is compiled once, for 910B3, in ``ASCEND_HIVM_JOBS`` (default 2)
processes started as soon as its ``.ttadapter`` exists, so they overlap the Python stages. 910B1,
B2 and B4 are compiled for two launches: their HIVM is B3's but for the core counts.
``make test-ascend-compile`` prints the per-launch table (``test_hivm_table``) and compiles
every launch; ``make test`` answers a launch whose input, flags and compiler are unchanged from
the HIVM cache (``ascend_hivm._cache_path``).

Needs triton-ascend (``make test-ascend`` runs it, without ``TRITON_INTERPRET``); skipped elsewhere.
Passing says that these stages accept the kernels and that the compiler's memory plan fits:
``hivmc`` (HIVM to an NPU binary, CANN only), the hardware and timing are untested.
"""

from __future__ import annotations

import importlib.metadata
import itertools
import os
from concurrent.futures import Future, ThreadPoolExecutor
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
from tests.ops import ascend_hivm as hivm  # noqa: E402
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
        return asc.choose_tiles(self.head, self.group, BLOCK, self.decode, self.neox)

    def __str__(self) -> str:
        kind = "decode" if self.decode else "prefill"
        return (f"{kind}-h{self.head}-{str(self.dtype)[6:]}-gqa{self.group}-"
                f"{'neox' if self.neox else 'gptj'}-"
                f"cs{'32' if self.cos_sin_fp32 else 'model'}")  # fmt: skip


def _features(c: Config) -> list[tuple]:
    """What a covering set must contain at least once."""
    k = c.decode
    return [
        ("tiles", k, c.head, c.neox, c.tiles()),  # every choose_tiles result per head
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


# The one shape over the UB budget: decode with GPT-J rotation at head 256, whose smallest tiles
# the compiler plans at 86.6% in float32 (78% in float16); listed so that its figure is in the
# table.
OVER_BUDGET = Config(256, torch.float32, 2, True, neox=False)


def over_budget_shape(label: str) -> bool:
    return label.startswith("decode-h256-") and "-gptj-" in label


CONFIGS = covering_configs()
CONFIGS += [OVER_BUDGET] if OVER_BUDGET not in CONFIGS else []
_compiled: dict[str, str | None] = {}  # launch key -> None (compiled) or the compiler's error
# launch key -> (where it was planned, kernel name), and its HIVM compiles per target.
_labels: dict[str, tuple[str, str]] = {}
_hivm: dict[str, dict[str, Future]] = {}
_ttadapter: dict[str, tuple[str, dict]] = {}  # launch key -> (.ttadapter text, metadata)
_pool = ThreadPoolExecutor(int(os.environ.get("ASCEND_HIVM_JOBS", "2")))


def compile_once(launch: asc.Launch, label: str = "") -> str | None:
    """Compile a launch through ttir and ttadapter once (by its key), then start its HIVM
    compiles for every target in the background."""
    key = launch_key(launch.kernel, launch.args, launch.kwargs)
    if key not in _compiled:
        _labels[key] = (label, launch.kernel.fn.__name__)
        try:
            ir, metadata = compile_stages(launch.kernel, launch.args, launch.kwargs)
            _compiled[key] = None
            _ttadapter[key] = (ir["ttadapter"], metadata)
            _hivm[key] = {hivm.ARCH: _pool.submit(hivm.compile_hivm, ir["ttadapter"], metadata,
                                                  hivm.ARCH)}  # fmt: skip
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
    for decode, head, group, neox in itertools.product((False, True), HEADS, GROUPS,
                                                       (True, False)):  # fmt: skip
        tiles = Config(head, torch.float16, group, decode, neox).tiles()
        assert any(c.decode == decode and c.head == head and c.neox == neox
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
        err = compile_once(launch, str(config))
        assert err is None, f"{launch.kernel.fn.__name__} ({config}):\n{err[-3000:]}"


def doctor_launches() -> list[tuple[str, asc.Launch]]:
    """`ascend-mepic doctor`'s self-test launches on a 910B (its batch, fp16/bf16, heads 64, 96
    and 128, the NPU's tile and dot choices), labelled."""
    from ascend_mepic.entrypoints import doctor

    out = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(asc, "INTERPRETED", False)  # the NPU's choices, as on a device
        for dtype in (torch.float16, torch.bfloat16):
            for head in doctor.SELF_TEST_HEADS:
                b = doctor.selftest_batch(head, dtype, "cpu")
                plan = asc.plan_launches(b["query"], b["kv_cache"], b["meta"], b["rope"],
                                         b["scale"], cores=CORES)  # fmt: skip
                assert plan.launches
                out += [(f"doctor-h{head}-{str(dtype)[6:]}", x) for x in plan.launches]
    return out


def test_doctor_self_test_launches_compile():
    """Each of the doctor's self-test launches compiles."""
    for label, launch in doctor_launches():
        err = compile_once(launch, label)
        assert err is None, f"{launch.kernel.fn.__name__} ({label}):\n{err}"


def hivm_reports() -> dict[str, dict[str, hivm.HivmReport | str]]:
    """Every launch of the two tests above (compiled here if they did not run) through the HIVM
    stage: launch key -> target -> its report, or the compiler's error."""
    for config in CONFIGS:
        for launch in planned(config):
            compile_once(launch, str(config))
    for label, launch in doctor_launches():
        compile_once(launch, label)
    out: dict[str, dict[str, hivm.HivmReport | str]] = {}
    for key, futures in _hivm.items():
        out[key] = {}
        for arch, future in futures.items():
            try:
                out[key][arch] = future.result()
            except hivm.HivmError as exc:
                out[key][arch] = str(exc)
    return out


def test_every_launch_reaches_the_final_hivm():
    """bishengir-compile takes every launch, for 910B3, to the final HIVM IR with no error
    but the missing hivmc; what it placed fits the target's UB and L1 (it checks that itself),
    and the placements read from the HIVM are the compiler's own records."""
    reports = hivm_reports()
    assert len(reports) == len(_compiled) >= 100  # every distinct launch, none failed earlier
    failed = [f"{_labels[k]} {arch}:\n{r[-2000:]}" for k, per in reports.items()
              for arch, r in per.items() if isinstance(r, str)]  # fmt: skip
    assert not failed, "\n".join(failed[:3])
    for key, per in reports.items():
        for arch, r in per.items():
            assert isinstance(r, hivm.HivmReport)
            assert r.used == r.display, (_labels[key], arch)
            assert r.capacity == {"ub": 192 * 1024, "cbuf": 512 * 1024, "cc": 128 * 1024}
            assert r.used["ub"] <= r.capacity["ub"] and r.used.get("cbuf", 0) <= r.capacity["cbuf"]
            want = "aiv" if _labels[key][1] in ("_rope_q_kernel", "combine_kernel") else "mix"
            assert r.mix_mode == want, (_labels[key], r.mix_mode)


def _estimate(label: str, kernel: str) -> int | None:
    """The planner's UB model (``ub_bytes``) for an attention launch of a compile-test
    configuration."""
    config = next((c for c in CONFIGS if str(c) == label), None)
    if config is None or kernel not in ("_prefill_kernel", "_decode_kernel"):
        return None
    block_q, block_n = config.tiles()
    group_p = asc.pow2_at_least(config.group, 1)  # plan_launches' rows: >= 16 for tl.dot
    rows = (asc.pow2_at_least(config.group, 16) if config.decode
            else max(block_q, 16 // group_p) * group_p)  # fmt: skip
    return asc.ub_bytes(rows, block_n, config.head, decode=config.decode, neox=config.neox)


def test_every_launch_is_under_the_ub_budget():
    """The compiler's own plan keeps every launch under ``UB_FRACTION`` (85%) of the unified
    buffer, but decode with GPT-J rotation at head 256 (``over_budget_shape``), whose smallest
    tiles are over; and the planner's model (``ub_bytes``) bounds each plan from above."""
    over, ratios = [], []
    for key, per in hivm_reports().items():
        label, kernel = _labels[key]
        for arch, r in per.items():
            assert isinstance(r, hivm.HivmReport)
            if r.fraction("ub") > asc.UB_FRACTION:
                over.append((label, kernel, arch, round(r.fraction("ub"), 3)))
            est = _estimate(label, kernel)
            if est is not None and not over_budget_shape(label):
                ratios.append((est / r.used["ub"], label, kernel))
    assert all(over_budget_shape(label) for label, *_ in over), over
    assert str(OVER_BUDGET) in {label for label, *_ in over}
    assert min(ratios)[0] >= 1.0, min(ratios)


def test_hivm_table():
    """Per launch: the compiler's planned UB and L1 (bytes, % of the target's) for B3 (B2's are
    the same), beside the planner's estimate; printed with -s (``make test-ascend-compile``)."""
    reports = hivm_reports()
    lines = [f"{'launch':44} {'kernel':15} {'mix':3} {'UB':>13} {'L1':>12} {'estimate':>9}"]
    for key in sorted(reports, key=lambda k: _labels[k]):
        label, kernel = _labels[key]
        per = reports[key]
        cells = []
        r = per[hivm.ARCH]
        assert isinstance(r, hivm.HivmReport)
        for space in ("ub", "cbuf"):
            cells.append(f"{r.used.get(space, 0):>7} {100 * r.fraction(space):4.1f}%")
        est = _estimate(label, kernel)
        lines.append(f"{label:44} {kernel:15} {r.mix_mode:3} {cells[0]:>13} {cells[1]:>12} "
                     f"{est if est else '':>9}")  # fmt: skip
    print("\n".join(lines))


def _ttadapter_of(launch: asc.Launch) -> tuple[str, dict]:
    assert compile_once(launch, "test") is None
    return _ttadapter[launch_key(launch.kernel, launch.args, launch.kwargs)]


OVERFLOW_TRIES = 4


def test_an_oversized_tile_overflows_ub():
    """The control: the stage can fail. Head 256 prefill with 32 rows x 128 keys passes ttir and
    ttadapter, and bishengir-compile refuses it for overflowing the unified buffer.

    The compiler's message for this refusal varies from run to run (measured on 20 runs: the
    ``ub overflow, requires N bits`` figure, only its retry note, or about 1 in 7 a bare
    ``Failed to run BiShengHIR pipeline``), so it runs up to ``OVERFLOW_TRIES`` times: every run
    must fail, and one must name the unified buffer."""
    query, kv, meta, rope, scale = _batch(Config(256, torch.float16, 1, False))
    plan = asc.plan_launches(query, kv, meta, rope, scale, kernel="prefill", cores=CORES,
                             block_q=32, block_n=128, half_dots=True)  # fmt: skip
    ttadapter, metadata = _ttadapter_of(plan.launches[1])
    text, _ = hivm.strip_mix_mode(ttadapter)
    outputs = []
    for _ in range(OVERFLOW_TRIES):
        with pytest.raises(hivm.HivmError) as err:
            hivm.run_compiler(text, metadata, "Ascend910B3")
        found = hivm.ub_overflow(err.value)
        if found:
            required, available = found
            assert required == available == 0 or required > available == 192 * 1024 * 8
            return
        outputs.append(str(err.value)[-1500:])
    raise AssertionError("no run named the unified buffer:\n" + "\n---\n".join(outputs))


def _small_launches() -> list[asc.Launch]:
    """A mix (cube + vector) and a vector-only launch that compile in about a second."""
    query, kv, meta, rope, scale = _batch(Config(64, torch.float16, 4, True))
    return asc.plan_launches(query, kv, meta, rope, scale, kernel="decode", cores=CORES,
                             num_splits=2, half_dots=True).launches  # fmt: skip


def test_memory_display_does_not_change_the_hivm():
    """``--enable-memory-display`` (the compiler's records the placements are checked against)
    is the one flag added to the backend's own: the final HIVM is the same without it."""
    for launch in _small_launches():
        text, _ = hivm.strip_mix_mode(_ttadapter_of(launch)[0])
        metadata = _ttadapter_of(launch)[1]
        with_display = hivm.run_compiler(text, metadata, "Ascend910B3")
        without = hivm.run_compiler(text, metadata, "Ascend910B3", display=False)
        assert with_display.display and with_display.hivm == without.hivm


def test_other_910b_targets_plan_as_b3():
    """910B1, B2 and B4 are not compiled for every launch: their target specs differ from B3's
    only in the core counts, and their final HIVM equals B3's but for that line."""
    for launch in _small_launches():
        text, _ = hivm.strip_mix_mode(_ttadapter_of(launch)[0])
        metadata = _ttadapter_of(launch)[1]
        a = hivm.run_compiler(text, metadata, hivm.ARCH, display=False).hivm.splitlines()
        for arch in hivm.SAME_AS_ARCH:
            b = hivm.run_compiler(text, metadata, arch, display=False).hivm.splitlines()
            differ = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
            assert len(differ) <= 1 and all("CORE_COUNT" in a[i] for i in differ), arch
            spec_a, spec_b = hivm.capacities("\n".join(a)), hivm.capacities("\n".join(b))
            assert spec_a == spec_b


def test_the_flags_are_the_backends():
    """``backend_flags`` follows triton-ascend's ``linalg_to_bin_enable_npu_compile_A2_A3``:
    every option flag it adds, in its order, and ``--enable-hivm-compile`` for a compiler
    without ``reg-based`` (1.2.0)."""
    import inspect
    import subprocess

    from triton.backends.ascend import compiler

    source = inspect.getsource(compiler.linalg_to_bin_enable_npu_compile_A2_A3)
    positions = [source.index(f'f"{flag}={{') for _, flag in hivm._OPTION_FLAGS]
    assert positions == sorted(positions)
    for flag in ("--enable-hfusion-compile=true", "--enable-hivm-compile=true",
                 "--enable-triton-kernel-compile=true"):  # fmt: skip
        assert flag in source
    help_text = subprocess.run([hivm.compiler_path(), "--help"], capture_output=True, text=True)
    assert "reg-based" not in help_text.stdout
    options = compiler.NPUOptions()
    assert hivm.backend_flags(options.__dict__, "Ascend910B3") == [
        "--target=Ascend910B3", "--enable-auto-multi-buffer=True",
        "--enable-auto-bind-sub-block=True", "--enable-hfusion-compile=true",
        "--enable-hivm-compile=true", "--enable-triton-kernel-compile=true",
    ]  # fmt: skip
