"""Policy and variant names of the dense transformers reference (``policy_reference``): what
``bench fidelity-ref`` and ``bench fidelity`` accept, parsed once, with errors naming the
spelling. Kept apart from the reference's arithmetic so the benchmarks can validate names
without importing torch's model code."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

_POLICY = re.compile(
    r"^(full|naive|mepic-block|mepic|epic|legolink|cacheblend|cachetune)(?:-(\d+))?$"
)
_POLICY_HELP = (
    "full, naive, mepic, mepic-K, mepic-block, epic-K, legolink-0, cacheblend-R, cachetune-R "
    "(K >= 1 tokens, 0 < R <= 100 percent)"
)
_MEPIC_K = 16  # mepic's default: the first 16 tokens of each chunk (MEPIC_DEFAULT_K)


def parse_policy(name: str) -> tuple[str, int | None]:
    """``"epic-16"`` -> ``("epic", 16)``; ``"mepic"`` -> ``("mepic", None)`` (K = 16).

    Raises ValueError naming the accepted forms, so a typo in a benchmark's policy list fails
    before any model work starts.
    """
    m = _POLICY.match(name.strip().lower()) if isinstance(name, str) else None
    if m is None:
        raise ValueError(f"unknown policy {name!r}; accepted: {_POLICY_HELP}")
    kind, raw = m.group(1), m.group(2)
    arg = None if raw is None else int(raw)
    if kind in ("full", "naive", "mepic-block") and arg is not None:
        raise ValueError(f"policy {kind!r} takes no number, got {name!r}")
    if kind == "legolink" and arg != 0:
        raise ValueError(f"only legolink-0 exists (LegoLink-K with K > 0 is epic-K), got {name!r}")
    if kind in ("epic", "cacheblend", "cachetune") and arg is None:
        raise ValueError(f"policy {kind!r} needs a number, e.g. {kind}-16, got {name!r}")
    if kind in ("mepic", "epic") and arg is not None and arg < 1:
        raise ValueError(f"{kind}-K needs K >= 1, got {name!r}")
    if kind in ("cacheblend", "cachetune") and not (arg is not None and 0 < arg <= 100):
        raise ValueError(f"{kind}-R needs 0 < R <= 100, got {name!r}")
    return kind, arg


ANCHOR_KINDS = ("prefix", "fixed")
# Anchors chosen by a sequence of requests (bench fidelity-ref --openings): passed as chunk_anchors.
SEQUENCE_ANCHORS = ("first", "auto", "engine")
_OPTION = re.compile(
    r"^(?:anchor=(prefix|fixed|first|auto|engine)|pick=q(\d*)|T=([0-9.]+)|S=([0-9.]+))$"
)
_VARIANT_HELP = (
    "naive|mepic|mepic-K, then +anchor=prefix|fixed|first|auto|engine (the last three: sequence "
    "state), "
    "+pick=q or +pick=qF (F first tokens kept, "
    "F < K), +T=x, +S=y (x, y > 0); pick needs a mepic base"
)


@dataclass(frozen=True)
class Variant:
    """A PIC variant (issue 65): ``k`` private tokens per chunk (the first ``k``, or with
    ``pick`` the first ``pick`` plus the rest chosen by question attention), an optional compile
    anchor, and APE's temperature / log-sum-exp scale for the query rows after the chunks."""

    name: str
    k: int
    anchor: str | None = None
    pick: int | None = None
    temperature: float = 1.0
    lse_scale: float = 1.0


def parse_variant(name: str) -> Variant:
    """``"mepic+anchor=prefix+pick=q4"`` -> Variant(k=16, anchor="prefix", pick=4).

    Raises ValueError naming the accepted forms (a typo fails before any model work).
    """
    base, *opts = name.strip().split("+") if isinstance(name, str) else ("",)
    if not opts:
        raise ValueError(f"{name!r} is no variant (no +option); accepted: {_VARIANT_HELP}")
    kind, arg = parse_policy(base)
    if kind not in ("naive", "mepic"):
        raise ValueError(f"variant base must be naive, mepic or mepic-K, got {base!r}")
    k = 0 if kind == "naive" else (_MEPIC_K if arg is None else arg)
    fields: dict[str, Any] = {}
    for opt in opts:
        m = _OPTION.match(opt)
        if m is None:
            raise ValueError(f"unknown option {opt!r} in {name!r}; accepted: {_VARIANT_HELP}")
        anchor, pick, temp, scale = m.groups()
        key = "anchor" if anchor else "pick" if pick is not None else "T" if temp else "S"
        if key in fields:
            raise ValueError(f"option {key} given twice in {name!r}")
        if anchor:
            fields[key] = anchor
        elif pick is not None:
            fields[key] = int(pick or 0)
        else:
            try:
                value = float(temp or scale)
            except ValueError:
                raise ValueError(f"bad number in {opt!r} of {name!r}") from None
            if not value > 0:
                raise ValueError(f"{key} must be > 0, got {opt!r} in {name!r}")
            fields[key] = value
    pick = fields.get("pick")
    if pick is not None and (k == 0 or pick >= k):
        raise ValueError(f"pick=qF needs a mepic base and F < K, got {name!r}")
    return Variant(
        name=name.strip(),
        k=k,
        anchor=fields.get("anchor"),
        pick=pick,
        temperature=fields.get("T", 1.0),
        lse_scale=fields.get("S", 1.0),
    )


def is_variant(name: str) -> bool:
    """Whether ``name`` is a variant spelling (has options) rather than a plain policy."""
    return isinstance(name, str) and "+" in name
