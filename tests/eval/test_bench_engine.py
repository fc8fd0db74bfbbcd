"""``ascend-mepic bench engine`` without an engine: the platform settings, the dummy model's
config, the workload file and the command's table and JSON (policies' processes stubbed).

The same command ran end to end on CPU with a 1-layer copy of the dummy Mistral-7B (see
docs/cuda.md); its CUDA settings are checked against vLLM's CUDA platform code in
``tests/cuda/test_engine_bench.py``. UNTESTED ON A GPU.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from ascend_mepic.core.segments import Segment
from ascend_mepic.eval import prepare
from ascend_mepic.eval.bench import engine, runner, workload_file
from ascend_mepic.eval.trace import SquadQuestion

CPU = SimpleNamespace(device_type="cpu")
CUDA = SimpleNamespace(device_type="cuda")


def test_cpu_setup_is_what_the_runner_always_passed(tmp_path):
    job = {"model": str(tmp_path), "kv_gib": 3}
    setup = runner.engine_setup(job, CPU)
    assert setup.llm_kwargs() == {"dtype": "float32", "enforce_eager": True}
    (tmp_path / prepare.DUMMY_NOTE).write_text("no weights")
    assert runner.engine_setup(job, CPU).llm_kwargs()["load_format"] == "dummy"
    with pytest.raises(ValueError, match="'compiled' is for CUDA"):
        runner.engine_setup({**job, "graphs": "compiled"}, CPU)
    with pytest.raises(RuntimeError, match="device 'cuda' but vLLM's platform here is cpu"):
        runner.engine_setup({**job, "device": "cuda"}, CPU)
    with pytest.raises(RuntimeError, match="CPU and CUDA platforms; this is 'npu'"):
        runner.engine_setup(job, SimpleNamespace(device_type="npu"))


def test_cuda_setup_sizes_the_pool_and_defaults_to_bf16_eager(tmp_path):
    (tmp_path / prepare.DUMMY_NOTE).write_text("no weights")
    job = {"model": str(tmp_path), "kv_gib": 4, "device": "cuda"}
    assert runner.engine_setup(job, CUDA).llm_kwargs() == {
        "dtype": "bfloat16",
        "enforce_eager": True,
        "load_format": "dummy",
        "kv_cache_memory_bytes": 4 << 30,
    }
    compiled = {**job, "graphs": "compiled", "gpu_memory_utilization": 0.5, "dtype": "float16"}
    kwargs = runner.engine_setup(compiled, CUDA).llm_kwargs()
    assert kwargs["enforce_eager"] is False and kwargs["gpu_memory_utilization"] == 0.5
    assert kwargs["dtype"] == "float16"


def test_dummy_config_keeps_the_published_layers_with_the_tokenizers_vocabulary():
    tok = prepare._tiny_tokenizer()
    published = prepare.REDUCED_ARCHITECTURES[prepare.DUMMY_MODELS["mistral7b-dummy"]].published
    values = prepare.dummy_config_values("mistral7b-dummy", tok)
    for key in (
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "num_hidden_layers",
        "rope_theta",
        "sliding_window",
    ):
        assert values[key] == published[key], key  # fmt: skip
    assert values["vocab_size"] == len(tok) != published["vocab_size"]
    assert values["eos_token_id"] == tok.eos_token_id
    assert prepare.dummy_config_values("mistral7b-dummy", tok, layers=2)["num_hidden_layers"] == 2
    assert published["vocab_size"] == 32768  # the published values are not changed
    with pytest.raises(ValueError, match="at least one layer"):
        prepare.dummy_config_values("mistral7b-dummy", tok, layers=0)


def _pairs(offset: int) -> list:
    q = SquadQuestion(f"q{offset}", "Who?", ("Ann", "ann"), 3, 1)
    segs = [Segment.prompt((1, 2)), Segment.chunk((5 + offset, 6, 7)), Segment.prompt((9,))]
    return [(q, segs)]


def test_workload_file_round_trip_and_tokenizer_check(tmp_path):
    model, other = tmp_path / "m", tmp_path / "o"
    for folder, text in ((model, "tok-a"), (other, "tok-b")):
        folder.mkdir()
        (folder / "tokenizer.json").write_text(text)
    job = {"requests": 1, "chunks": 1, "seed": 0, "articles": 1}
    path = tmp_path / "w.json"
    header = workload_file.save(path, model, job, _pairs(0), _pairs(100))
    assert header["params"] == job and header["num_warmup"] == 1
    data = workload_file.load(path)
    assert workload_file.requests(data) == _pairs(0)
    assert workload_file.warmup(data) == _pairs(100)
    workload_file.check_model(data, path, model)
    with pytest.raises(ValueError, match="another tokenizer"):
        workload_file.check_model(data, path, other)
    # the runner takes both from the file
    file_job = {"workload_file": str(path), "model": str(model)}
    assert runner.build_requests(None, file_job) == _pairs(0)
    assert runner.warmup_requests(None, file_job, []) == _pairs(100)


def _raw(policy: str) -> dict:
    reqs = [
        {
            "index": i,
            "arrival_s": 0.25 * i,
            "first_token_s": 0.25 * i + 0.02 * (i + 1),
            "finish_s": 0.25 * i + 0.1,
            "prompt_tokens": 900,
            "answers": ["x"],
            "text": "",
            "output_tokens": 8,
            "first_token": 3,
            "top_logprobs": {},
            "num_cached_tokens": 0 if policy == "prefix" else None,
            "finish_reason": "length",
        }
        for i in range(4)
    ]
    engine_info = {"device": "cuda", "dtype": "bfloat16", "enforce_eager": True,
                   "resolved_enforce_eager": True, "startup_s": 30.0,
                   "gpu_name": "H200"}  # fmt: skip
    engine_info.update(
        {"attention_backend": "FLASH_ATTN", "attention_impl": "FlashAttentionImpl",
         "flash_attn_version": 3} if policy == "prefix" else
        {"attention_backend": "CUSTOM", "attention_impl": "MepicAttentionImpl"}
    )  # fmt: skip
    return {
        "policy": policy,
        "workload": "squad-chat-4p",
        "qps": 4.0,
        "block_size": 16,
        "max_tokens": 8,
        "pool_blocks": 2047,
        "block_bytes": 2 << 20,
        "kv_timeline": [[0.1, 60], [0.2, 120]],
        "per_request": reqs,
        "manager_metrics": {"tokens_computed": 900, "tokens_reused": 2700}
        if policy == "mepic"
        else {},
        "engine": engine_info,
        "warmup_s": 1.0,
    }


def test_bench_engine_reports_every_policy_and_a_failed_one(tmp_path, monkeypatch, capsys):
    from ascend_mepic.entrypoints.cli import main

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["MistralForCausalLM"],
                "num_hidden_layers": 32,
                "hidden_size": 4096,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "head_dim": 128,
                "vocab_size": 49152,
            }
        )  # fmt: skip
    )
    (model / prepare.DUMMY_NOTE).write_text("no weights")
    jobs = []

    def run_policy(job: dict, out: Path, timeout: float) -> dict:
        jobs.append(job)
        if job["policy"] == "full":
            raise RuntimeError("policy full failed (rc 1); log x:\nTriton error")
        return _raw(job["policy"])

    monkeypatch.setattr(engine, "run_policy", run_policy)
    out = tmp_path / "out"
    argv = ["bench", "engine", "--model", str(model), "--device", "cuda", "--out", str(out)]
    assert main([*argv, "--policies", "prefix", "mepic", "full"]) == 1
    table = capsys.readouterr().out
    assert "| prefix | FLASH_ATTN FA3 | eager | 50.0 / 50.0 / 74.0 |" in table
    assert "| mepic | CUSTOM MepicAttentionImpl | eager |" in table
    assert "| full | FAILED: RuntimeError: policy full failed (rc 1); log x: |" in table
    assert "on H200" in table and "dummy weights" in table
    assert {j["device"] for j in jobs} == {"cuda"} and jobs[0]["kv_gib"] == 4
    assert jobs[0]["requests"] == 24 and jobs[0]["qps"] == 4.0 and jobs[0]["max_tokens"] == 8
    assert jobs[0]["warmup_requests"] == engine.WARMUP_REQUESTS and jobs[0]["logprobs"] is None
    report = json.loads((out / "engine.json").read_text())
    assert [r["policy"] for r in report["rows"]] == ["prefix", "mepic"]
    mepic = report["rows"][1]
    assert mepic["recomputed_tokens_per_request"] == 225 and mepic["peak_kv_blocks"] == 120
    assert mepic["throughput_req_s"] == pytest.approx(4 / 0.85)
    assert report["failures"]["full"].startswith("RuntimeError: policy full failed")
    assert report["model"]["dummy"] and report["model"]["head_dim"] == 128
