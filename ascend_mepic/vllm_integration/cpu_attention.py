"""Stock vLLM's CPU attention kernel (vLLM 0.30.0's ``CPU_ATTN`` ops): the kernel benchmark's base.

Why here: ``eval/bench/kernels.py`` times MEPIC's CPU kernel against the kernel stock vLLM runs on
the same machine, called as vLLM's CPU backend calls it (its ISA choice, its cache write, its
scheduler metadata). Those are vLLM's private ops (``vllm._custom_ops``) and a private helper
(``_get_attn_isa``), so their use is kept in this one module.
"""

from __future__ import annotations

import torch


def kernel_block_base() -> int:
    """The multiple every block size of stock vLLM's CPU kernel must be (32 in vLLM 0.30.0)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    (base,) = [s.base for s in CPUAttentionBackend.get_supported_kernel_block_sizes()]
    return base


class StockCpuAttention:
    """vLLM's CPU paged attention over one batch of sequences with contiguous block tables.

    K arrives rotated (stock vLLM rotates at write time). ``run`` writes into ``out`` as the
    engine's attention layer does.
    """

    def __init__(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        slots: torch.Tensor,
        num_blocks: int,
        block_size: int,
        block_tables: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        num_heads: int,
        dtype: torch.dtype,
    ) -> None:
        """``key``/``value``: ``[tokens, Hkv, D]`` (K rotated), written at ``slots``."""
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        num_kv_heads, head = key.shape[1], key.shape[2]
        self.isa = _get_attn_isa(dtype, block_size, head)
        if self.isa == "amx":
            # Linux hands out AMX tile state only on request (arch_prctl XCOMP_PERM); without it
            # the first tile instruction is SIGILL. vLLM's engine has it requested by the time
            # attention runs; calling the op directly must ask first.
            torch._C._cpu._init_amx()
        # [nb, Hkv, 2B, D]: K rows then V rows of a block.
        raw = torch.zeros(num_blocks, num_kv_heads, 2 * block_size, head, dtype=dtype)
        self.key_cache, self.value_cache = raw.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(
            key.to(dtype), value.to(dtype), self.key_cache, self.value_cache, slots, self.isa
        )
        self.block_tables = block_tables
        self.query_start_loc = query_start_loc
        self.seq_lens = seq_lens
        self.scheduler_metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(seq_lens), num_heads=num_heads, num_kv_heads=num_kv_heads,
            head_dim=head, seq_lens=seq_lens, dtype=dtype, query_start_loc=query_start_loc,
            causal=True, sliding_window_size=-1, isa=self.isa, enable_kv_split=True,
        )  # fmt: skip
        self._ops = ops

    def run(self, query: torch.Tensor, out: torch.Tensor, scale: float) -> torch.Tensor:
        self._ops.cpu_attention_with_kv_cache(
            query=query, key_cache=self.key_cache, value_cache=self.value_cache,
            output=out, query_start_loc=self.query_start_loc, seq_lens=self.seq_lens,
            scale=scale, causal=True, alibi_slopes=None, sliding_window=-1,
            block_table=self.block_tables, softcap=0.0,
            scheduler_metadata=self.scheduler_metadata, s_aux=None,
        )  # fmt: skip
        return out
