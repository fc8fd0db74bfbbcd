"""Device profiles: what the simulator's cost model knows about a device, as data.

A profile is a JSON file (``profiles/*.json`` here, or any path). Published profiles derive their
rates from a device's specification times an efficiency, and name a source for every figure (or
say it is an assumption); calibrated profiles are written by ``ascend-mepic bench profile`` from
a measured run on the device itself, and replace the published figures with fitted ones.

Every rate is effective: ``peak_tflops * gemm_efficiency`` is the dense-GEMM rate the model's
linear layers run at, ``hbm_tb_s * memory_efficiency`` the rate weights and KV stream at.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

PROFILE_DIR = Path(__file__).parent / "profiles"
KINDS = ("published", "calibrated")


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    description: str
    kind: str  # "published" (specification x efficiency) or "calibrated" (fitted on the device)
    hbm_gib: float  # device memory
    memory_utilization: float  # vLLM's gpu_memory_utilization
    activation_reserve_gib: float  # memory neither weights nor KV (activations, workspace)
    peak_tflops: float  # dense fp16/bf16 (fp32 on a CPU)
    gemm_efficiency: float  # fraction of peak the linear layers reach
    attention_efficiency: float  # fraction of peak attention's matmuls reach
    hbm_tb_s: float  # memory bandwidth
    memory_efficiency: float  # fraction of it streaming reads reach
    host_gb_s: float  # host <-> device copies (private-placement chunk loads and saves)
    step_overhead_ms: float  # per engine step: scheduling, launch, sampling, output processing
    seq_overhead_ms: float  # per sequence in a step
    rope_read_overhead: float  # extra attention time of rotating K at read (0.2 = +20%)
    dtype_bytes: int = 2  # weights and KV
    # A calibrated profile's step overhead includes streaming the weights of the model it was
    # fitted on (a CPU step is never compute-idle), so it is only valid for that model.
    weights_in_overhead: bool = False
    calibrated_on: dict[str, Any] | None = None
    sources: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(
                f"profile {self.name!r}: kind must be one of {KINDS}, got {self.kind!r}"
            )
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type == "float" and (not isinstance(v, int | float) or v < 0):
                raise ValueError(
                    f"profile {self.name!r}: {f.name} must be a number >= 0, got {v!r}"
                )
        for name in ("gemm_efficiency", "attention_efficiency", "memory_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"profile {self.name!r}: {name} must be in (0, 1]")
        if not 0 < self.memory_utilization <= 1:
            raise ValueError(f"profile {self.name!r}: memory_utilization must be in (0, 1]")
        if self.kind == "published":
            missing = [
                f.name for f in fields(self) if f.type == "float" and f.name not in self.sources
            ]
            if missing:
                raise ValueError(
                    f"published profile {self.name!r} names no source for {missing}: give one "
                    "per figure, or write 'assumption: ...'"
                )

    @property
    def gemm_flops_s(self) -> float:
        return self.peak_tflops * 1e12 * self.gemm_efficiency

    @property
    def attention_flops_s(self) -> float:
        return self.peak_tflops * 1e12 * self.attention_efficiency

    @property
    def memory_bytes_s(self) -> float:
        return self.hbm_tb_s * 1e12 * self.memory_efficiency

    @property
    def host_bytes_s(self) -> float:
        return self.host_gb_s * 1e9

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1) + "\n"


@dataclass(frozen=True)
class StepNoise:
    """Step times as a real device gives them: every priced step is multiplied by ``scale``
    (the run is that much slower) and by a log-normal factor of spread ``sigma`` drawn from a
    generator seeded with ``seed`` (step-to-step noise), so a replay is repeatable."""

    scale: float = 1.0
    sigma: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.scale <= 0 or self.sigma < 0:
            raise ValueError(f"step noise needs scale > 0 and sigma >= 0, got {self}")


def available_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def load_profile(name_or_path: str | Path) -> DeviceProfile:
    """A bundled profile by name (``ascend-910b-64g``) or a JSON file (``bench profile``'s)."""
    path = Path(name_or_path)
    if not path.suffix:
        path = PROFILE_DIR / f"{name_or_path}.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"no device profile {str(name_or_path)!r}; bundled: {available_profiles()}, or give "
            "the path of a JSON file written by `ascend-mepic bench profile`"
        )
    raw = json.loads(path.read_text(encoding="utf-8"))
    known = {f.name for f in fields(DeviceProfile)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{path}: unknown profile field(s) {unknown}; known: {sorted(known)}")
    try:
        return DeviceProfile(**raw)
    except TypeError as e:
        raise ValueError(f"{path}: {e}") from None
