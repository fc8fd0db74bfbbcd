"""What MEPIC's option models share: pydantic's settings and one readable error message.

``config.MepicConfig`` and ``tier.index.TierConfig`` are pydantic dataclasses, as vLLM's own
configs are: frozen, unknown keys refused, each scalar field ``Strict()`` ("false" is not a
bool, 1.0 is not an int; an int is a float).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import ConfigDict, ValidationError

OPTIONS = ConfigDict(extra="forbid")


def _field_names(cls: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def explain(error: ValidationError, root: Any, prefix: str = "MEPIC") -> str:
    """pydantic's errors as one message: each option's path, what is wrong, what it accepts."""
    lines = []
    for e in error.errors(include_url=False):
        loc = [str(part) for part in e["loc"]]
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "unexpected_keyword_argument":
            cls, where = root, ""
            for part in loc[:-1]:  # the nested option model the unknown key was given to
                cls = cls.__pydantic_fields__[part].annotation
                where = f"{where}{part} "
            lines.append(
                f"unknown {prefix} {where}option {'.'.join(loc)!r}; known: {_field_names(cls)}"
            )
        elif loc:
            lines.append(f"{prefix} option {'.'.join(loc)!r}: {msg}, got {e['input']!r}")
        else:
            lines.append(msg)
    return "; ".join(lines)


def build(cls: Any, options: dict[str, Any], prefix: str = "MEPIC") -> Any:
    """``cls(**options)``, its validation errors as one ``ValueError`` (see ``explain``)."""
    try:
        return cls(**options)
    except ValidationError as e:
        raise ValueError(explain(e, cls, prefix)) from None
