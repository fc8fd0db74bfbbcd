"""MEPIC's NPU worker, runner and attention backend on vllm-ascend 0.30.0rc2's real classes.

Runs in ``.venv-ascend`` (``make test-ascend``): torch_npu is the documented-semantics double
(``tests/ops/npu_double.py``, through ``conftest.py``) and ``triton`` is triton-ascend, run by its
interpreter (``TRITON_INTERPRET=1``). The backend's forward runs on CPU tensors laid out as
vllm-ascend lays out its KV cache, through both NPU attention implementations, against the torch
reference and the dense oracle. Nothing here ran on an NPU.
"""

from __future__ import annotations

import random
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from ascend_mepic.core.segments import Segment, build_packed_layout
from ascend_mepic.ops import SequenceSpec, build_metadata, npu, rope_paged_attention, write_kv
from ascend_mepic.ops.reference import rope_paged_attention_reference
from ascend_mepic.ops.rope import RopeSpec, default_cos_sin_cache
from ascend_mepic.vllm_integration import ascend as va
from tests.ops.oracle import _table, dense_oracle, random_batch

BS = 128  # vllm-ascend's only kernel block size
FP32 = (torch.float16, torch.bfloat16, torch.float32)


@pytest.fixture
def allocate_kv(monkeypatch, vllm_config):
    """One layer's KV as vllm-ascend 0.30.0rc2 itself allocates it: real vLLM ``Attention`` layers
    built on the NPU platform (which, with MEPIC's backend selection installed, get MEPIC's
    backend and impl), then ``NPUModelRunner.initialize_kv_cache_tensors`` run on a
    ``MepicNPUModelRunner`` with just the attributes that method reads (building a runner needs
    a device). Returns ``make(num_blocks, kv_heads, head, dtype) -> (runner, layers)``."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention import Attention
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )
    from vllm.v1.worker.utils import AttentionGroup
    from vllm_ascend.ascend_config import get_ascend_config
    from vllm_ascend.platform import NPUPlatform

    from ascend_mepic.worker.npu_worker import MepicNPUModelRunner

    monkeypatch.setattr(NPUPlatform, "get_attn_backend_cls", NPUPlatform.get_attn_backend_cls)
    va.use_attention_backend()
    vllm_config.cache_config.block_size = BS

    def make(num_blocks: int, kv_heads: int, head: int, dtype: torch.dtype, num_layers: int = 1):
        names = [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]
        with set_current_vllm_config(vllm_config):
            layers = [
                Attention(4 * kv_heads, head, head**-0.5, num_kv_heads=kv_heads, prefix=name)
                for name in names
            ]
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=kv_heads, head_size=head, dtype=dtype)
        size = num_blocks * spec.page_size_bytes
        config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[
                KVCacheTensor(size, [name], size, spec.page_size_bytes) for name in names
            ],
            kv_cache_groups=[KVCacheGroupSpec(names, spec)],
        )
        runner = MepicNPUModelRunner.__new__(MepicNPUModelRunner)
        runner.__dict__.update(
            vllm_config=vllm_config,
            compilation_config=vllm_config.compilation_config,
            model_config=SimpleNamespace(hf_text_config=SimpleNamespace(model_type="llama")),
            ascend_config=get_ascend_config(),
            device=torch.device("cpu"),
            kv_caches=[],
            shared_kv_cache_layers={},
            runner_only_attn_layers=set(),
            dcp_size=1,
            use_sparse=False,
            use_compress=False,
            sparse_kv_offload_enabled=False,
            sparse_kv_offload_config=None,
            use_hybrid_blocks=False,
            tp_rank=0,
            kv_cache_config=config,
            attn_groups=[[AttentionGroup(layers[0].attn_backend, names, spec, 0)]],
            _kv_buffers=None,
        )
        runner.initialize_kv_cache_tensors(config, [BS])
        return runner, layers

    return make


def ascend_kv_pair(make, num_blocks: int, kv_heads: int, head: int, dtype: torch.dtype):
    runner, _ = make(num_blocks, kv_heads, head, dtype)
    return runner.kv_caches[0]


# ------------------------------------------------------------------------------------------
# The classes the Ascend path subclasses.


def test_mepic_classes_subclass_vllm_ascends():
    from vllm_ascend.attention.attention_v1 import AscendAttentionBackend
    from vllm_ascend.worker.model_runner_v1 import NPUModelRunner
    from vllm_ascend.worker.worker import NPUWorker

    from ascend_mepic.worker.model_runner import MepicRunnerMixin
    from ascend_mepic.worker.npu_attention import MepicAscendAttentionBackend
    from ascend_mepic.worker.npu_worker import MepicNPUModelRunner, MepicNPUWorker

    assert issubclass(MepicNPUWorker, NPUWorker)
    assert issubclass(MepicNPUModelRunner, NPUModelRunner)
    assert issubclass(MepicNPUModelRunner, MepicRunnerMixin)
    assert issubclass(MepicAscendAttentionBackend, AscendAttentionBackend)
    # What vllm-ascend derives from its backend stays as it is.
    assert MepicAscendAttentionBackend.get_supported_kernel_block_sizes() == [128]
    assert (
        MepicAscendAttentionBackend.get_kv_cache_shape(9, BS, 2, 64)
        == AscendAttentionBackend.get_kv_cache_shape(9, BS, 2, 64)
        == (2, 9, BS, 2, 64)
    )
    assert MepicAscendAttentionBackend.forward_includes_kv_cache_update
    assert MepicAscendAttentionBackend.get_name() == "CUSTOM"


def test_worker_class_for_this_platform_is_the_npu_worker():
    from ascend_mepic.offline import worker_cls_for_platform
    from ascend_mepic.vllm_integration.class_names import NPU_WORKER_CLS

    assert worker_cls_for_platform() == NPU_WORKER_CLS
    module, _, name = NPU_WORKER_CLS.rpartition(".")
    assert getattr(__import__(module, fromlist=[name]), name).__name__ == "MepicNPUWorker"


def test_mepic_entry_points_pick_the_npu_worker_in_eager_mode():
    from argparse import Namespace

    from ascend_mepic.entrypoints.server.launch import apply_mepic_defaults
    from ascend_mepic.offline import mepic_llm_kwargs
    from ascend_mepic.vllm_integration.class_names import NPU_WORKER_CLS

    kwargs = mepic_llm_kwargs(policy="mepic")
    assert kwargs["worker_cls"] == NPU_WORKER_CLS and kwargs["enforce_eager"]
    args = Namespace(
        scheduler_cls=None, worker_cls="auto", enable_prefix_caching=None, block_size=None,
        additional_config={"mepic": {"stats_file": "/tmp/unused.json"}}, enforce_eager=False,
    )  # fmt: skip
    assert apply_mepic_defaults(args, is_cpu=False) is None
    assert args.worker_cls == NPU_WORKER_CLS and args.enforce_eager
    assert args.block_size is None  # vllm-ascend picks 128


def test_vllm_serve_with_a_mepic_config_selects_mepic(monkeypatch, vllm_config):
    """``vllm serve MODEL --additional-config '{"mepic": {}}'``: MEPIC's general plugin makes
    the NPU platform's config step choose MEPIC's worker and scheduler; other configs keep
    vllm-ascend's choices."""
    from vllm_ascend.platform import NPUPlatform

    from ascend_mepic import plugin
    from ascend_mepic.vllm_integration.class_names import NPU_WORKER_CLS, SCHEDULER_CLS

    monkeypatch.setattr(NPUPlatform, "check_and_update_config", NPUPlatform.check_and_update_config)
    plugin.register()
    plugin.register()  # every vLLM process runs it; wrapping stays single
    vllm_config.parallel_config.worker_cls = "auto"
    vllm_config.scheduler_config.scheduler_cls = None
    NPUPlatform.check_and_update_config(vllm_config)
    assert vllm_config.parallel_config.worker_cls != NPU_WORKER_CLS
    vllm_config.additional_config = {"mepic": {}}
    vllm_config.parallel_config.worker_cls = "auto"
    NPUPlatform.check_and_update_config(vllm_config)
    assert vllm_config.parallel_config.worker_cls == NPU_WORKER_CLS
    assert vllm_config.scheduler_config.scheduler_cls == SCHEDULER_CLS
    vllm_config.scheduler_config.scheduler_cls = "vllm_ascend.core.x.OtherScheduler"
    with pytest.raises(ValueError, match="MEPIC needs its scheduler"):
        NPUPlatform.check_and_update_config(vllm_config)


# One row per row of docs/ascend.md's routing table (head size, dtype, GQA ratio -> path).
ROUTES = [
    (128, torch.bfloat16, 1, True, "npu"),  # FIA's native shape: CANN's own ops, MHA too
    (128, torch.float16, 4, True, "npu"),
    (64, torch.bfloat16, 1, True, "npu"),  # FIA's TND paged mode: head 64 and 128 at any ratio
    (64, torch.float16, 8, True, "npu"),
    (80, torch.bfloat16, 4, True, "npu"),  # GQA/MQA: any multiple of 16 up to 256
    (96, torch.float16, 2, True, "npu"),
    (256, torch.bfloat16, 8, True, "npu"),
    (256, torch.float16, 64, True, "npu"),  # FIA's largest ratio
    (96, torch.bfloat16, 1, True, "triton-ascend"),  # MHA at 80/96/256: not in the table
    (256, torch.float16, 1, True, "triton-ascend"),
    (96, torch.bfloat16, None, True, "triton-ascend"),  # ratio unknown: taken as MHA
    (256, torch.bfloat16, 128, True, "triton-ascend"),  # ratio over FIA's 64
    (72, torch.bfloat16, 4, True, "triton-ascend"),  # not a multiple of 16
    (512, torch.bfloat16, 4, True, "triton-ascend"),  # over 256 (vllm-ascend avoids TND there)
    (128, torch.float32, 4, True, "triton-ascend"),  # FIA takes no float32
    (96, torch.float32, 4, True, "triton-ascend"),
    (None, None, None, True, "triton-ascend"),
    (128, torch.float32, 4, False, "npu"),  # without the kernel: attends in bfloat16
    (96, torch.float32, 4, False, "npu"),
    (None, None, None, False, "npu"),
]


@pytest.mark.parametrize(("head_size", "dtype", "group", "with_kernel", "expected"), ROUTES)
def test_the_npu_default_depends_on_head_size_dtype_and_gqa_ratio(
    monkeypatch, head_size, dtype, group, with_kernel, expected
):
    from ascend_mepic.ops import select_impl

    monkeypatch.delenv("ASCEND_MEPIC_ATTN_IMPL", raising=False)
    monkeypatch.setattr("ascend_mepic.ops.have_triton_ascend", lambda: with_kernel)
    assert select_impl(torch.device("npu", 0), head_size, dtype, group) == expected


def test_the_composition_takes_what_it_is_routed():
    """Every shape routed to the composition passes its own limits check (and MHA at 96 not)."""
    from ascend_mepic.ops.npu import check_npu_supported

    for head_size, _, group, _, expected in ROUTES:
        if expected == "npu" and group is not None:
            check_npu_supported(group * 2, 2, head_size)
    with pytest.raises(ValueError, match="head size 96"):
        check_npu_supported(8, 8, 96)


def test_a_shape_no_npu_path_takes_is_refused_naming_both_paths(monkeypatch):
    from ascend_mepic.ops import NoNpuAttentionError, select_impl

    monkeypatch.delenv("ASCEND_MEPIC_ATTN_IMPL", raising=False)
    monkeypatch.setattr("ascend_mepic.ops.have_triton_ascend", lambda: False)
    with pytest.raises(NoNpuAttentionError, match="head size 96.*triton-ascend"):
        select_impl(torch.device("npu", 0), 96, torch.bfloat16)


def test_platform_selects_mepic_backend_once_installed(monkeypatch, vllm_config):
    from vllm.platforms import current_platform
    from vllm.v1.attention import selector
    from vllm.v1.attention.selector import AttentionSelectorConfig
    from vllm_ascend.platform import NPUPlatform

    monkeypatch.setattr(NPUPlatform, "get_attn_backend_cls", NPUPlatform.get_attn_backend_cls)
    config = AttentionSelectorConfig(
        head_size=128, dtype=torch.bfloat16, kv_cache_dtype=None, block_size=128
    )
    va.use_attention_backend()
    va.use_attention_backend()  # idempotent
    try:
        assert current_platform.get_attn_backend_cls(None, config) == va.MEPIC_NPU_BACKEND
        with pytest.raises(ValueError, match="standard attention only"):
            current_platform.get_attn_backend_cls(None, config._replace(use_mla=True))
    finally:
        selector._cached_get_attn_backend.cache_clear()


def test_nope_rope_replaces_vllm_ascends_rotary_ops(monkeypatch, vllm_config):
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm_ascend.utils import register_ascend_customop

    from ascend_mepic.worker import nope_rotary as rope

    monkeypatch.setattr("vllm.model_executor.custom_op.op_registry_oot", dict(op_registry_oot))
    registry = dict(op_registry_oot)
    monkeypatch.setattr(rope, "_installed", False)
    with monkeypatch.context() as m:
        m.setattr("vllm.model_executor.custom_op.op_registry_oot", registry)
        register_ascend_customop(vllm_config)  # what NPUWorker.__init__ does first
        assert registry["RotaryEmbedding"].__name__ == "AscendRotaryEmbedding"
        with pytest.raises(AssertionError, match="Duplicate"):
            rope.install_nope_rope()  # vLLM's documented hook refuses the taken names
        rope.install_nope_rope(replace_registered=True)
        assert registry["RotaryEmbedding"].__name__ == "NopeRotaryEmbedding"
        assert registry["RotaryEmbedding"].mepic_base_name == "RotaryEmbedding"
        assert registry["MRotaryEmbedding"].__name__ == "RejectedMRotaryEmbedding"


def test_eager_mode_is_required(vllm_config):
    from ascend_mepic.worker.npu_worker import check_eager

    with pytest.raises(ValueError, match="enforce-eager"):
        check_eager(SimpleNamespace(model_config=SimpleNamespace(enforce_eager=False)))
    check_eager(SimpleNamespace(model_config=SimpleNamespace(enforce_eager=True)))


# ------------------------------------------------------------------------------------------
# vllm-ascend's KV layout.


def test_vllm_ascend_allocates_mepic_layers_the_layout_mepic_views(allocate_kv):
    """The KV vllm-ascend's own allocation gives MEPIC's attention layers: per layer a (K, V)
    pair of [num_blocks, 128, Hkv, D] views over one block-major buffer (its strided layout),
    bound to the layer; MEPIC's views address exactly that memory."""
    from ascend_mepic.worker.npu_attention import MepicAscendAttentionBackend, MepicNPUAttentionImpl

    runner, layers = allocate_kv(5, 2, 64, torch.bfloat16, num_layers=2)
    assert all(type(layer.impl) is MepicNPUAttentionImpl for layer in layers)
    assert all(layer.attn_backend is MepicAscendAttentionBackend for layer in layers)
    assert len(runner.kv_caches) == 2
    k, v = runner.kv_caches[0]
    assert layers[0].kv_cache is runner.kv_caches[0] or layers[0].kv_cache[0] is runner.kv_caches[0]
    assert k.shape == v.shape == (5, BS, 2, 64) and k.dtype == torch.bfloat16
    assert tuple(MepicAscendAttentionBackend.get_kv_cache_shape(5, BS, 2, 64)) == (2, *k.shape)
    view = va.kv_pair_view((k, v))
    assert view.shape == (2, 5, BS, 2, 64)
    view[0, 3, 7, 1] = 1.0
    view[1, 4, 0, 0] = 2.0
    assert k[3, 7, 1].eq(1).all() and v[4, 0, 0].eq(2).all()
    block_major = va.block_major_buffer((k, v))
    assert block_major.is_contiguous() and block_major.shape == (5, 2, BS, 2, 64)
    assert block_major[3, 0, 7, 1].eq(1).all() and block_major[4, 1, 0, 0].eq(2).all()


def test_scatter_into_vllm_ascends_strided_views_equals_indexed_write(npu_ops, allocate_kv):
    """The KV write as vllm-ascend's ``DeviceOperator.reshape_and_cache`` makes it: its K and V
    views (block-strided) and int32 slots."""
    k, v = ascend_kv_pair(allocate_kv, 6, 2, 64, torch.bfloat16)
    view = va.kv_pair_view((k, v))
    want = view.clone()
    slots = torch.tensor([0, 5, 130, 767, 300, 129])
    key = torch.randn(6, 2, 64).bfloat16()
    value = torch.randn(6, 2, 64).bfloat16()
    write_kv(key, value, want, slots)
    assert not k.is_contiguous() and k[0].is_contiguous()
    npu_ops.npu_scatter_pa_kv_cache(key, value, k, v, slots.to(torch.int32), cache_mode="Norm")
    assert torch.equal(view, want)
    with pytest.raises(Exception, match="block-strided"):  # other strides are refused
        npu_ops.npu_scatter_pa_kv_cache(
            key, value, k.transpose(1, 2), v.transpose(1, 2), slots, cache_mode="Norm"
        )


def test_other_layouts_are_refused():
    k = torch.zeros(4, BS, 2, 64)
    v = torch.zeros(4, BS, 2, 64)  # vllm-ascend's contiguous-PA layout: separate K and V
    with pytest.raises(va.UnsupportedAscendLayout, match="strided KV layout"):
        va.kv_pair_view((k, v))


def test_runner_hands_block_major_buffers_to_the_tier_code(allocate_kv):
    from ascend_mepic.tier import transfer

    runner, _ = allocate_kv(4, 2, 64, torch.float32, num_layers=3)
    buffers = runner.mepic_kv_buffers()
    assert [b.shape for b in buffers] == [(4, 2, BS, 2, 64)] * 3
    for k, v in runner.kv_caches:
        k.normal_()
        v.normal_()
    saved = transfer.save_tokens(buffers, [1, 2], 100, 50, BS)
    transfer.load_tokens(buffers, saved, [3, 0], 10, BS)
    for k, v in runner.kv_caches:
        src_k = torch.cat((k[1, 100:], k[2, :22]))
        torch.testing.assert_close(k[3, 10:60], src_k)
        torch.testing.assert_close(v[3, 10:60], torch.cat((v[1, 100:], v[2, :22])))


# ------------------------------------------------------------------------------------------
# The backend's forward on realistic MEPIC steps.


def realistic_step(seed: int, hq: int, hkv: int, head: int, decode: bool):
    """A step at block 128: request A (system prompt, two 150-token chunks recomputing their
    first 16 tokens, a question) with the chunk cache already filled, a compile of a new chunk
    as its own sequence, and a plain request; or, with ``decode``, one new token for each."""
    rng = random.Random(seed)
    req = [
        Segment.prompt(range(1, 20)),
        Segment.chunk(range(150)),
        Segment.chunk(range(150)),
        Segment.prompt(range(1, 10)),
    ]
    compile_ = [Segment.chunk(range(60)), Segment.prompt([1])]
    plain = [Segment.prompt(range(1, 20))]
    layouts = [
        build_packed_layout(req, BS, [16, 16], [0, 72]),
        build_packed_layout(compile_, BS, [0], [16]),
        build_packed_layout(plain, BS, [], []),
    ]
    ids = list(range(1, sum(x.num_blocks for x in layouts) + 6))
    num_blocks = len(ids) + 1
    rng.shuffle(ids)
    specs, fresh_slots = [], []
    for layout in layouts:
        table = _table(layout, ids)
        positions = layout.slot_positions()
        real = [i for i, p in enumerate(positions) if p >= 0]
        private = {i for b, spec in enumerate(layout.blocks) if spec.private_block >= 0
                   for i in range(b * BS + spec.valid_start, b * BS + spec.valid_end)}  # fmt: skip
        if decode:
            queries = [real[-1]]
        elif layout is layouts[1]:
            queries = real  # a compile computes every token of its chunk
        else:
            queries = [i for i in real if i in private]  # fresh tokens only
        specs.append(
            SequenceSpec(
                block_ids=table,
                block_first_pos=[b.first_position for b in layout.blocks],
                block_valid_start=[b.valid_start for b in layout.blocks],
                block_valid_end=[b.valid_end for b in layout.blocks],
                query_indices=queries,
                query_positions=[positions[i] for i in queries],
            )
        )
        fresh_slots += [table[i // BS] * BS + i % BS for i in queries]
    meta = build_metadata(specs, BS)
    return meta, torch.tensor(fresh_slots), num_blocks


@pytest.mark.parametrize("impl", ["triton-ascend", "npu"])
@pytest.mark.parametrize("decode", [False, True])
def test_backend_forward_on_vllm_ascend_cache_equals_reference(
    monkeypatch, npu_ops, allocate_kv, impl, decode
):
    from ascend_mepic.worker.attention import MepicAttentionMetadata
    from ascend_mepic.worker.npu_attention import MepicNPUAttentionImpl

    hq, hkv, head, dtype = 8, 2, 128, torch.bfloat16
    meta, slots, num_blocks = realistic_step(3, hq, hkv, head, decode)
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = ascend_kv_pair(allocate_kv, num_blocks, hkv, head, dtype)
    k_cache.copy_(torch.randn(k_cache.shape, generator=gen))  # the cached chunks' KV
    v_cache.copy_(torch.randn(v_cache.shape, generator=gen))
    t = meta.num_queries
    query = torch.randn(t, hq * head, generator=gen).to(dtype)
    key = torch.randn(t, hkv * head, generator=gen).to(dtype)
    value = torch.randn(t, hkv * head, generator=gen).to(dtype)
    rope = RopeSpec.from_cache(default_cos_sin_cache(head, 4096, 10000.0), True)

    want_cache = va.kv_pair_view((k_cache, v_cache)).clone()
    write_kv(key.view(t, hkv, head), value.view(t, hkv, head), want_cache, slots)
    q = query.view(t, hq, head)
    want = rope_paged_attention_reference(q.float(), want_cache.float(), meta, rope, head**-0.5)
    oracle = dense_oracle(q, want_cache, meta, 10000.0, True, head**-0.5)

    impl_ = MepicNPUAttentionImpl(hq, head, head**-0.5, hkv, None, None, "auto")
    impl_._rope = rope
    layer = SimpleNamespace(layer_name="model.layers.0.self_attn.attn")
    output = torch.empty(t, hq * head, dtype=dtype)
    monkeypatch.setenv("ASCEND_MEPIC_ATTN_IMPL", impl)
    step = MepicAttentionMetadata(t, meta, slot_mapping=slots)
    impl_.forward(layer, query, key, value, (k_cache, v_cache), step, output)

    assert torch.equal(va.kv_pair_view((k_cache, v_cache)), want_cache)  # NoPE K/V written
    out = output.view(t, hq, head).double()
    torch.testing.assert_close(out, want.double(), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(out, oracle, atol=3e-2, rtol=3e-2)
    calls = {name for name, _ in npu_ops.calls}
    assert "npu_scatter_pa_kv_cache" in calls
    assert ("npu_fused_infer_attention_score" in calls) == (impl == "npu")


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("decode", [False, True])
def test_held_out_random_batches_on_vllm_ascend_cache(
    monkeypatch, npu_ops, allocate_kv, seed, decode
):
    """Random padded/packed tables (GQA, both RoPE styles) viewed through vllm-ascend's layout,
    through both NPU implementations, at fp32 (the double widened to take fp32)."""
    b = random_batch(seed, BS, 8, 2, head=128, neox=seed % 2 == 0, decode=decode, max_segment=30)
    k_cache, v_cache = ascend_kv_pair(allocate_kv, b.kv_cache.shape[1], 2, 128, torch.float32)
    view = va.kv_pair_view((k_cache, v_cache))
    view.copy_(b.kv_cache)
    want = dense_oracle(b.query, b.kv_cache, b.meta, b.base, b.rope.is_neox_style, b.scale)
    npu_ops.attention_dtypes = FP32
    monkeypatch.setattr(npu, "FIA_DTYPES", FP32)
    monkeypatch.setattr("tests.ops.npu_double.KV_CACHE_DTYPES", FP32)
    for impl in ("triton-ascend", "npu"):
        monkeypatch.setenv("ASCEND_MEPIC_ATTN_IMPL", impl)
        out = rope_paged_attention(b.query, view, replace(b.meta, memo={}), b.rope, b.scale)
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
