"""Compile triton-ascend kernels for a 910B as far as a machine without CANN can: the ``ttir``
and ``ttadapter`` stages of triton-ascend's own compiler (then ``tests/ops/ascend_hivm.py``:
BiSheng IR's ``bishengir-compile`` to the final HIVM).

triton-ascend's ``AscendBackend`` lowers a kernel in three stages: ``ttir`` (Triton IR, Python and
MLIR passes), ``ttadapter`` (``triton-adapter-opt``, an x86 binary in the wheel: Triton IR to
linalg/HIVM, where block-pointer, mask and gather analyses run) and ``npubin`` (BiSheng IR's
compiler, then CANN's ``hivmc``). The first two run here on exactly the launches the launcher plans
(``plan_launches``): the specialisation (argument dtypes, divisibility) is triton's own binder's,
as at a real launch. Errors the interpreter can never show (a value the code generator cannot
convert, a pointer form the adapter's analyses reject) surface here.

What only CANN's ``hivmc`` or a 910B can still reject is in ``CANN_ONLY_CHECKS`` (the 910B
bring-up list).
"""

from __future__ import annotations

import hashlib
from typing import Any

STAGES = ("ttir", "ttadapter")
# 910B3 (Atlas A2): the target vllm-ascend's 910B builds name.
TARGET_ARCH = "Ascend910B3"

# Not checked here (bishengir-compile's own checks, UB and L1 included, run in the HIVM stage);
# the first 910B run must watch for each (docs/ascend.md, "Bring-up").
CANN_ONLY_CHECKS = (
    "hivmc (HIVM to the NPU binary) and CANN's own bishengir-compile build, which may place "
    "more in the unified buffer than ascendnpu-ir 1.2.0 (the 85% budget's margin)",
    "float32 decode with GPT-J rotation at head 256: the compiler places 86.6% of the unified "
    "buffer at the smallest tiles (over the 85% budget)",
    "3-D block pointers: none remain (every tile is 2-D with unit inner stride); a 3-D form "
    "would be accepted by ttadapter and could still fail in HIVM",
    "stride-2 loads: none remain for Q, K or cos/sin (GPT-J pairs are split with tl.split); the "
    "decode split's log-sum-exp store is strided by NUM_SPLITS",
    "scratch store/load ordering: the prefill kernel writes rotated K to its own HBM scratch "
    "and reads it back in a later tile of the same program without a barrier",
    "scalar loads with masks (the decode query's position and index) and integer division by "
    "constexprs in loop bounds",
    "tl.dot shapes: rows >= 16, K = HALF_P (32..128), fp32 dots for fp32 models",
)


def _backend():
    from triton.backends.ascend.compiler import AscendBackend
    from triton.backends.compiler import GPUTarget

    return AscendBackend(GPUTarget("npu", TARGET_ARCH, 0))


def specialise(kernel: Any, args: tuple, kwargs: dict[str, Any]):
    """``(backend, options, signature, constants, attrs)`` for a launch, as ``JITFunction.run``
    derives them (triton-ascend 3.2), without a driver or a device."""
    backend = _backend()
    if kernel.binder is None:
        kernel.create_binder(backend)
    bound_args, sig_and_spec, _, _, _ = kernel.binder(*args, **kwargs)
    options = backend.parse_options(kwargs)
    values = tuple(bound_args.values())
    names = [kernel.params[i].name for i in kernel.non_constexpr_indices]
    types = sig_and_spec[: len(names)]
    signature = {k: ("*i8" if v == "none" else v) for k, v in zip(names, types, strict=True)}
    attrs = backend.get_attrs_descriptor(kernel.params, values)
    specialised = attrs.get_constants()
    constants = {
        p.name: v
        for v, p in zip(values, kernel.params, strict=True)
        if p.is_constexpr or p.num in specialised or v is None
    }
    return backend, options, signature, constants, attrs


def launch_key(kernel: Any, args: tuple, kwargs: dict[str, Any]) -> str:
    """What makes two launches the same compilation (kernel, signature, constants, attrs)."""
    _, options, signature, constants, attrs = specialise(kernel, args, kwargs)
    text = repr((kernel.fn.__name__, signature, sorted(constants.items()), attrs.to_dict()))
    return hashlib.sha256(text.encode()).hexdigest()


def compile_stages(
    kernel: Any, args: tuple, kwargs: dict[str, Any]
) -> tuple[dict[str, str], dict[str, Any]]:
    """Run ``STAGES`` on one launch; returns each stage's IR text and the compile metadata (the
    options the backend's later stage reads its flags from). Raises the compiler's error
    (``CompilationError``, or ``CalledProcessError`` with triton-adapter-opt's stderr)."""
    from triton._C.libtriton import ir
    from triton.compiler.compiler import ASTSource

    backend, options, signature, constants, attrs = specialise(kernel, args, kwargs)
    src = ASTSource(kernel, signature, constants, attrs)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    stages: dict[str, Any] = {}
    backend.add_stages(stages, options)
    metadata = {"hash": src.hash(), "target": backend.target, **options.__dict__}
    module = src.make_ir(options, backend.get_codegen_implementation(), backend.get_module_map(),
                         context)  # fmt: skip
    out = {}
    for stage in STAGES:
        module = stages[stage](module, metadata)
        out[stage] = str(module)
    return out, metadata


def error_text(exc: BaseException) -> str:
    """The compiler's own words: the adapter's stderr, or the code generator's message."""
    stderr = getattr(exc, "stderr", None)
    if stderr:
        return stderr.decode(errors="replace") if isinstance(stderr, bytes) else str(stderr)
    return f"{type(exc).__name__}: {exc}"
