"""Triton kernels for MEPIC's fused-RoPE paged attention (the CUDA path of ``ascend_mepic.ops``).

MEPIC keeps chunk K un-rotated in vLLM's paged cache so one copy serves every position; the
rotation is applied inside attention at read time.
``rope_paged_attention.rope_paged_attention_triton`` implements the contract of
``ascend_mepic.ops.reference``. It has been tested only on CPU under ``TRITON_INTERPRET=1``; it has
not been run on a real GPU.
"""
