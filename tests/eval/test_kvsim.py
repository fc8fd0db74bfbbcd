"""kvsim: JSON schema, and MEPIC's peak blocks against an independently computed ideal."""

import json
import random

from ascend_mepic.core.segments import Segment, SegmentKind, build_layout
from ascend_mepic.entrypoints.cli import main
from ascend_mepic.eval.kvsim import OUTPUT_KEYS, parse_trace, simulate

B = 32


def synthetic_trace(n=120, seed=0, qps=20.0):
    """SQuAD-like: a shared system prompt, 4 of 30 paragraphs as chunks, a question."""
    rng = random.Random(seed)
    docs = [[rng.randint(3, 4000) for _ in range(rng.randint(60, 220))] for _ in range(30)]
    system = [1] + [rng.randint(3, 4000) for _ in range(27)]
    t = 0.0
    lines = []
    for i in range(n):
        t += rng.expovariate(qps)
        segs = [{"type": "prompt", "tokens": system}]
        for d in rng.sample(range(len(docs)), 4):
            segs.append({"type": "chunk", "tokens": docs[d]})
        segs.append({"type": "prompt", "tokens": [rng.randint(3, 4000) for _ in range(15)]})
        line = {
            "id": f"r{i}",
            "arrival": round(t, 4),
            "duration": 0.5 + rng.random(),
            "output_tokens": 16,
            "segments": segs,
        }
        if i % 10 == 0:
            line["salt"] = "tenant-b"
        lines.append(json.dumps(line))
    return lines


def ideal_peak(trace):
    """Max over time of unique canonical chunk blocks of live requests plus private blocks."""
    events = sorted({r.arrival for r in trace} | {r.arrival + r.duration for r in trace})
    peak = 0
    for t in events:
        live = [r for r in trace if r.arrival <= t < r.arrival + r.duration]
        chunks, private = set(), 0
        for r in live:
            layout = build_layout(r.segments, B)
            for span in layout.spans:
                if span.kind is SegmentKind.CHUNK and span.num_blocks > 1:
                    chunks.add((r.salt, layout.chunk_tokens(span), span.num_blocks - 1))
            shared = sum(s.num_blocks - 1 for s in layout.chunk_spans)
            total = -(-(layout.num_padded_tokens + r.output_tokens) // B)
            private += total - shared
        peak = max(peak, private + sum(n for *_, n in chunks))
    return peak


def test_schema_and_mepic_peak_within_5_percent_of_ideal():
    trace = parse_trace(synthetic_trace())
    results = {p: simulate(trace, p, 4096, B) for p in ("mepic", "private", "prefix")}
    for r in results.values():
        assert tuple(r) == OUTPUT_KEYS
        assert r["requests"] == len(trace) and r["rejected"] == 0
        assert r["peak_usage"] == round(r["peak_blocks"] / 4096, 6)
    ideal = ideal_peak(trace)
    mepic = results["mepic"]
    assert mepic["peak_blocks"] <= 1.05 * ideal
    # The shared system-prompt block comes from the prefix cache, so MEPIC may beat the ideal,
    # but only by that one block per live request.
    assert mepic["peak_blocks"] >= 0.8 * ideal
    assert mepic["peak_blocks"] * 2 < results["private"]["peak_blocks"]
    assert mepic["chunk_hits"] > mepic["chunk_misses"] > 0
    assert mepic["tokens_computed"] < results["private"]["tokens_computed"]
    assert results["private"]["tokens_computed"] == results["private"]["tokens_total"]


def test_pressure_defers_and_evicts_but_serves_everything():
    trace = parse_trace(synthetic_trace(n=60, qps=200.0))
    r = simulate(trace, "mepic", 160, B)
    assert r["requests"] == 60 and r["rejected"] == 0
    assert r["peak_blocks"] <= 159
    assert r["chunk_evictions"] > 0


def test_too_big_request_is_rejected_not_fatal():
    big = {
        "id": "big",
        "arrival": 0.0,
        "duration": 1.0,
        "output_tokens": 1,
        "segments": [
            {"type": "chunk", "tokens": list(range(5, 2000))},
            {"type": "prompt", "tokens": [1]},
        ],
    }
    ok = {
        "id": "ok",
        "arrival": 0.5,
        "duration": 1.0,
        "output_tokens": 1,
        "segments": [{"type": "prompt", "tokens": [1, 2, 3]}],
    }
    trace = parse_trace([json.dumps(big), json.dumps(ok)])
    for placement in ("mepic", "private", "prefix"):
        r = simulate(trace, placement, 32, B)
        assert (r["requests"], r["rejected"]) == (1, 1)


def test_cli_writes_exact_schema(tmp_path, capsys):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(synthetic_trace(n=20)) + "\n")
    out = tmp_path / "out.json"
    assert (
        main(["kvsim", str(path), "--placement", "mepic", "--block-size", "32", "--json", str(out)])
        == 0
    )
    result = json.loads(out.read_text())
    assert tuple(result) == OUTPUT_KEYS and result["placement"] == "mepic"
    assert all(len(p) == 2 for p in result["timeline"])
    assert "| mepic |" in capsys.readouterr().out
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "arrival": 0, "duration": 1, "segments": [{"type": "doc"}]}\n')
    assert main(["kvsim", str(bad)]) == 2


def test_text_segments_use_tokenizer_per_segment():
    class Chars:
        bos_token_id = 1

        def encode(self, text, add_special_tokens=True):
            return [ord(c) for c in text]

    line = json.dumps(
        {
            "id": "t",
            "arrival": 0,
            "duration": 1,
            "output_tokens": 2,
            "segments": [{"type": "chunk", "text": "abc"}, {"type": "prompt", "text": "q"}],
        }
    )
    (req,) = parse_trace([line], Chars())
    assert req.segments == [
        Segment.prompt([1]),
        Segment.chunk(map(ord, "abc")),
        Segment.prompt([ord("q")]),
    ]
