"""An emulated NPU placement for CPU tensors: which tensors are "on the device", and who moved them.

Without an NPU every "device" tensor is a CPU tensor, so a composition that forgets a
``.to(device)`` (a host tensor built per step and handed to an op) runs fine here and fails on the
910B. This module gives CPU tensors a device mark that the torch_npu double checks.

Design (why not a tensor subclass: the marked tensors flow through vLLM, ``torch.library`` ops and
in-place writes, where a wrapper subclass must re-implement dispatch and is easily unwrapped):

* The mark is on the tensor's **storage** (a ``WeakSet`` of ``UntypedStorage`` objects, which
  torch keeps one per storage while it lives), so every view (slicing, ``view``, ``transpose``,
  basic indexing) of a marked tensor is marked with no help, and a freed storage forgets its mark.
* ``NPU`` is ``torch.device("cpu", 0)``: a real CPU device (every native call accepts it), yet
  distinct from the host ``torch.device("cpu")``. The host is ``cpu``, the emulated NPU ``cpu:0``.
* ``emulated_npu()`` is a ``TorchFunctionMode`` for the code under test. While it is active:
  a marked tensor's ``.device`` reads ``NPU`` (so ``device = kv_cache.device`` names the NPU and a
  later ``.to(device)`` is a move to it); ``.to(NPU)`` / ``.to(marked_tensor)`` and factories with
  ``device=NPU`` give marked tensors (a move is a copy, as on hardware: the host tensor stays
  unmarked); ``.to("cpu")`` / ``.cpu()`` give unmarked copies; any other call marks its tensor
  outputs when one of its tensor inputs is marked (``.contiguous()``, ``.to(dtype)``, arithmetic,
  ``index_select``, ...). With ``default_npu=True`` a factory without a device lands on the NPU,
  like ``torch.set_default_device("npu")``. Nested, the innermost mode alone sees a call.
* ``mark_npu(*tensors)`` is how a test says "these tensors live on the NPU" (what vLLM hands
  a backend: the query, the KV cache).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

NPU = torch.device("cpu", 0)  # the emulated NPU; the host is torch.device("cpu")
HOST = torch.device("cpu")

_MARKED: weakref.WeakSet[torch.UntypedStorage] = weakref.WeakSet()

# Factories whose output device is their ``device`` argument (default: the default device).
_FACTORIES: frozenset[Callable[..., Any]] = frozenset(
    {
        torch.empty,
        torch.empty_strided,
        torch.zeros,
        torch.ones,
        torch.full,
        torch.rand,
        torch.randn,
        torch.randint,
        torch.randperm,
        torch.arange,
        torch.linspace,
        torch.eye,
        torch.tensor,
        torch.as_tensor,
        torch.triu_indices,
        torch.tril_indices,
    }
)
_DEVICE_GET = torch.Tensor.device.__get__  # type: ignore[attr-defined]


class NotOnNpuError(RuntimeError):
    """A host tensor reached an NPU op (on hardware: a device mismatch or a host pointer)."""


def on_npu(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage is marked as living on the emulated NPU."""
    return t.untyped_storage() in _MARKED


def mark_npu(*tensors: torch.Tensor) -> None:
    """Declare ``tensors`` (and every view of their storage) to be on the emulated NPU."""
    for t in tensors:
        _MARKED.add(t.untyped_storage())


def mark_outputs(result: Any) -> Any:
    """Mark every tensor in ``result`` (an op's output) as on the NPU; returns ``result``."""
    for leaf in tree_flatten(result)[0]:
        if isinstance(leaf, torch.Tensor):
            _MARKED.add(leaf.untyped_storage())
    return result


def require_on_npu(op: str, named: dict[str, Any]) -> None:
    """Raise ``NotOnNpuError`` naming every tensor argument of ``op`` not on the NPU."""
    host = [
        name
        for name, value in named.items()
        for leaf in tree_flatten(value)[0]
        if isinstance(leaf, torch.Tensor) and not on_npu(leaf)
    ]
    if host:
        raise NotOnNpuError(
            f"{op}: {', '.join(sorted(set(host)))} not on the NPU (a host tensor: missing "
            ".to(device)?)"
        )


def _parse_to(args: tuple, kwargs: dict) -> tuple:
    """``Tensor.to``'s (device, dtype, non_blocking, memory_format); torch's parser takes no
    ``copy`` (by keyword, or positional after ``non_blocking``)."""
    kwargs = {k: v for k, v in kwargs.items() if k != "copy"}
    with torch._C.DisableTorchFunction():
        try:
            return torch._C._nn._parse_to(*args, **kwargs)
        except (RuntimeError, TypeError):
            return torch._C._nn._parse_to(*args[:-1], **kwargs)


def _target_device(func: Callable[..., Any], args: tuple, kwargs: dict) -> torch.device | None:
    """The device a move/factory call targets, or None when it names none."""
    if func is torch.Tensor.to:
        if len(args) > 1 and isinstance(args[1], torch.Tensor):
            return NPU if on_npu(args[1]) else HOST
        device = _parse_to(args[1:], kwargs)[0]
        return None if device is None else torch.device(device)
    if func is torch.Tensor.cpu:
        return HOST
    device = kwargs.get("device")
    return torch.device(device) if isinstance(device, (str, torch.device)) else None


class EmulatedNpu(TorchFunctionMode):
    """Propagates device marks through the torch calls of the code under test (module docstring)."""

    def __init__(self, default_npu: bool = False) -> None:
        super().__init__()
        self.default_npu = default_npu

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func == _DEVICE_GET:
            return NPU if on_npu(args[0]) else _DEVICE_GET(args[0])
        target = _target_device(func, args, kwargs)
        with torch._C.DisableTorchFunction():  # native calls; an outer mode does not see them
            if func is torch.Tensor.to and target is not None:
                # Natively on HOST: a tensor already where it goes comes back itself.
                _, dtype, non_blocking, memory_format = _parse_to(args[1:], kwargs)
                fmt = torch.preserve_format if memory_format is None else memory_format
                copy = bool(kwargs.get("copy", False))
                result = args[0].to(
                    device=HOST, dtype=dtype, non_blocking=non_blocking, copy=copy,
                    memory_format=fmt,
                )  # fmt: skip
            else:
                result = func(*args, **kwargs)  # NPU is a CPU device: native calls accept it
        if target is not None:
            source = args[0] if func in (torch.Tensor.to, torch.Tensor.cpu) else None
            if (
                source is not None
                and on_npu(source) != (target == NPU)
                and result.untyped_storage() is source.untyped_storage()
            ):
                with torch._C.DisableTorchFunction():
                    result = result.clone()  # a move between host and device is a copy
            return mark_outputs(result) if target == NPU else result
        if target is None and func in _FACTORIES and self.default_npu:
            return mark_outputs(result)
        inputs = tree_flatten((args, kwargs))[0]
        if any(isinstance(t, torch.Tensor) and on_npu(t) for t in inputs):
            mark_outputs(result)
        return result


@contextmanager
def emulated_npu(default_npu: bool = False) -> Iterator[EmulatedNpu]:
    """Run the enclosed code with device marks propagated (see the module docstring)."""
    with EmulatedNpu(default_npu) as mode:
        yield mode
