"""Test-side speed-ups for the Triton CPU interpreters the tests run; results are unchanged.

Profiled on the emulated-NPU engine loop (``tests/ascend/test_engine_loop.py``, triton-ascend
3.2.0) 70% of the time, and on ``tests/ops/test_triton.py`` (upstream Triton 3.9.0) 30%, went to
interpreter costs that have nothing to do with the kernels under test:

- **The language re-patched at every device-function call** (both interpreters). Each call of a
  ``@triton.jit`` helper (``softmax_step``, ``_load_tile``, ...) runs ``_patch_lang``, which walks
  every member of ``triton.language`` with ``inspect.getmembers`` (1-2 ms, tens of thousands of
  calls per engine step) and finds it already patched. triton-ascend 3.2.0 patches for good, so
  here it patches once per language module. Triton 3.9.0 patches at each kernel launch and
  restores after it; here a device-function call inside a launch that already patched its
  language modules skips the walk.
- **``tl.max`` reduced element by element in Python** (triton-ascend only). triton-ascend's
  ``tl.max`` and ``tl.min`` (``triton.triton_patch.language.standard``) pass their own combine
  functions (``_elementwise_max_default``, ...), and its interpreter sends only upstream's to
  numpy; every other combine function takes the generic path, one Python call per element: 67 ms
  for one softmax tile's row max. Max and min are exact in any order, so ``np.max``/``np.min``
  give the same values (NaN propagates in both, as the element-wise ``np.maximum`` does).

``install()`` is called once per test process by ``tests/conftest.py`` wherever triton was
imported; ``tests/ops/test_interpreter_speed.py`` checks that kernels give bit-identical results
with and without it, under both interpreters. Nothing here runs outside the tests, and the
kernels' code is untouched.
"""

from __future__ import annotations

import importlib.metadata

import numpy as np

_INSTALLED = False


def triton_ascend_version() -> str | None:
    try:
        return importlib.metadata.version("triton-ascend")
    except importlib.metadata.PackageNotFoundError:
        return None


def upstream_triton_version() -> str | None:
    if triton_ascend_version() is not None:
        return None
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None


def install() -> bool:
    """Install the speed-ups into triton-ascend 3.2.0's or Triton 3.9.0's interpreter; False
    (and nothing done) for any other triton, whose interpreter they were not checked against."""
    global _INSTALLED
    if _INSTALLED:
        return True
    if triton_ascend_version() == "3.2.0":
        from triton.runtime import interpreter

        _numpy_reductions(interpreter)
        _patch_language_once(interpreter)
    elif upstream_triton_version() == "3.9.0":
        from triton.runtime import interpreter

        _patch_language_once_per_launch(interpreter)
    else:
        return False
    _INSTALLED = True
    return True


def uninstall() -> None:
    """Restore the interpreter (for the equivalence test)."""
    global _INSTALLED
    from triton.runtime import interpreter

    for owner, name in ((interpreter.ReduceOps, "apply_impl"), (interpreter, "_patch_lang")):
        real = getattr(getattr(owner, name), "_real", None)
        if real is not None:
            setattr(owner, name, real)
    _INSTALLED = False


def _numpy_reductions(interpreter) -> None:
    from triton.triton_patch.language import standard as ascend_standard

    to_numpy = {
        ascend_standard._elementwise_max_default: np.max,
        ascend_standard._elementwise_max_propagate_nan: np.max,
        ascend_standard._elementwise_min: np.min,
    }
    real = interpreter.ReduceOps.apply_impl

    def apply_impl(self, input):
        op = to_numpy.get(self.combine_fn)
        if op is None:
            return real(self, input)
        return self.min_max(input[0], val_reduce_op=op, idx_reduce_op=None)

    apply_impl._real = real
    interpreter.ReduceOps.apply_impl = apply_impl


def _patch_language_once(interpreter) -> None:
    import triton.language as tl

    real = interpreter._patch_lang
    done: set[int] = set()  # the language modules patched
    seen: set[object] = set()  # the functions whose languages are all in ``done``

    def _patch_lang(fn):
        if fn in seen:
            return
        langs = {id(v) for v in (tl, tl.core) if any(g is v for g in fn.__globals__.values())}
        if not langs or not langs <= done:
            real(fn)  # raises as before for a function that sees no triton.language
            done.update(langs)
        seen.add(fn)

    _patch_lang._real = real
    interpreter._patch_lang = _patch_lang


def _patch_language_once_per_launch(interpreter) -> None:
    import triton.language as tl

    real = interpreter._patch_lang
    active: set[int] = set()  # the language modules the running launch has patched

    def _patch_lang(fn):
        langs = {id(v) for v in (tl, tl.core) if any(g is v for g in fn.__globals__.values())}
        if active and langs and langs <= active:  # a device function inside a launch
            return interpreter._LangPatchScope()
        scope = real(fn)
        active.update(langs)
        restore = scope.restore

        def restore_and_forget() -> None:  # the launch's own scope, restored when it ends
            restore()
            active.clear()

        scope.restore = restore_and_forget
        return scope

    _patch_lang._real = real
    interpreter._patch_lang = _patch_lang
