"""A double of vllm-ascend's compiled op library (``vllm_ascend.vllm_ascend_C``).

vllm-ascend's AscendC/ACLNN kernels are built with CANN into ``vllm_ascend_C``, whose import
registers them as ``torch.ops._C_ascend.*``; without CANN they are not built
(``scripts/test_ascend.sh``). Its Llama path calls some of them unconditionally (e.g.
``AscendRMSNorm`` with a residual imports ``vllm_ascend_C`` and calls
``npu_add_rms_norm_bias``). For vllm-ascend's engine loop to run on CPU tensors
(``tests/ascend/test_engine_loop.py``), ``install()`` registers the ops listed in ``OPS`` under
``_C_ascend`` with plain-torch implementations of their semantics (read from vllm-ascend
0.30.0rc2's ``csrc/torch_binding.cpp`` schemas and the ops' documentation), and makes
``import vllm_ascend.vllm_ascend_C`` succeed. Any other ``_C_ascend`` op stays missing, so a
path that needs one fails with torch's "no such op" error instead of computing something.
"""

from __future__ import annotations

import sys
import types

import torch

NAMESPACE = "_C_ascend"


def npu_add_rms_norm_bias(
    x1: torch.Tensor,
    x2: torch.Tensor,
    gamma: torch.Tensor,
    beta: torch.Tensor | None = None,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x = x1 + x2``; ``y = x * rstd * gamma (+ beta)`` with ``rstd`` over gamma's dims
    (float32, those dims kept as 1); returns ``(y, rstd, x)``."""
    x = x1 + x2
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(dim=dims, keepdim=True) + epsilon)
    y = x32 * rstd * gamma.float()
    if beta is not None:
        y = y + beta.float()
    return y.to(x1.dtype), rstd, x


# name -> (schema, implementation)
OPS = {
    "npu_add_rms_norm_bias": (
        "npu_add_rms_norm_bias(Tensor x1, Tensor x2, Tensor gamma, Tensor? beta=None, "
        "float epsilon=1e-6) -> (Tensor y, Tensor rstd, Tensor x)",
        npu_add_rms_norm_bias,
    ),
}

_library: torch.library.Library | None = None


def install() -> None:
    """Register ``OPS`` (once per process) and make ``vllm_ascend.vllm_ascend_C`` importable."""
    global _library
    if _library is not None:
        return
    if hasattr(torch.ops, NAMESPACE) and any(
        hasattr(getattr(torch.ops, NAMESPACE), name) for name in OPS
    ):
        return  # the real library is loaded: leave it alone
    library = torch.library.Library(NAMESPACE, "FRAGMENT")
    for name, (schema, fn) in OPS.items():
        library.define(schema)
        library.impl(name, fn, "CompositeExplicitAutograd")
    _library = library
    module = types.ModuleType("vllm_ascend.vllm_ascend_C")
    module.__doc__ = "registered by tests/ascend/ascend_c_double.py"
    sys.modules["vllm_ascend.vllm_ascend_C"] = module


def uninstall() -> None:
    """Undo ``install()``: drop the ops and the module, and let vllm-ascend ask again whether its
    custom ops exist (``vllm_ascend.utils.enable_custom_op`` caches the answer)."""
    global _library
    if _library is None:
        return
    _library._destroy()
    _library = None
    sys.modules.pop("vllm_ascend.vllm_ascend_C", None)
    import vllm_ascend.utils

    vllm_ascend.utils._CUSTOM_OP_ENABLED = None
