"""MEPIC's CUDA Triton kernels: fused-RoPE paged attention, the CUDA path of ``ascend_mepic.ops``.

MEPIC keeps chunk K un-rotated in vLLM's paged cache so one copy serves every position; the
rotation is applied inside attention at read time.
``rope_paged_attention.rope_paged_attention_triton`` implements the contract of
``ascend_mepic.ops.reference``; it is tested under ``TRITON_INTERPRET=1`` and on one H100
(``tests/gpu/test_gpu_kernels.py``), not inside vLLM on a GPU.

CUDA kernels only: the NPU kernels live in ``ascend_mepic.ops`` (``triton_ascend``, written for
triton-ascend, and ``npu``, the torch_npu composition). What this kernel shares with the
triton-ascend one (rotation, scores, online softmax, the split-KV combine kernel, input checks)
is written once, in ``ascend_mepic.ops.triton_common``.
"""
