"""``ascend-mepic doctor`` on this machine (no NPU, no GPU): it runs, says plainly that there is
no NPU, self-tests the CPU path's op, keeps stdout for its data, and turns what it finds into
the exit status (version mismatches on the NPU platform warn, failures fail)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from importlib.metadata import PackageNotFoundError, distribution

import pytest

from ascend_mepic.entrypoints import doctor
from ascend_mepic.entrypoints.doctor import Report


def _torch_npu_installed() -> bool:
    try:
        distribution("torch-npu")
    except PackageNotFoundError:
        return False
    return True


@pytest.fixture(scope="module")
def run() -> tuple[subprocess.CompletedProcess, dict]:
    """The real command, as a user runs it (its own process: stdout isolation is on)."""
    env = {k: v for k, v in os.environ.items() if k != "ASCEND_MEPIC_ATTN_IMPL"}
    proc = subprocess.run(
        [sys.executable, "-m", "ascend_mepic.entrypoints.cli", "doctor", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(proc.stdout)  # the whole of stdout is the JSON document


def test_doctor_passes_here_and_stdout_is_only_its_json(run):
    proc, data = run
    assert data["ok"] is True and data["failures"] == []
    assert "doctor: done" in proc.stderr  # logs go to stderr


@pytest.mark.skipif(_torch_npu_installed(), reason="torch-npu is installed here")
def test_doctor_reports_no_npu_and_the_cpu_platform(run):
    _, data = run
    npu = data["devices"]["npu"]
    assert npu["present"] is False and "torch-npu" in npu["reason"]
    assert data["platform"]["device_type"] == "cpu"
    assert data["devices"]["cpu"]["machine"]
    vllm = next(r for r in data["versions"] if r["package"] == "vllm")
    assert vllm["status"] == "ok" and vllm["pinned"] == "0.30.0"
    # The 910B pins are shown but not held against a CPU machine.
    assert {r["package"]: r["status"] for r in data["versions"]}["torch-npu"] == "info"
    assert set(data["ops"]["impls"]) == {"reference", "cpu", "triton", "triton-ascend", "npu"}


def test_doctor_self_tested_the_cpu_op(run):
    _, data = run
    st = data["self_test"]
    assert st["device"] == "cpu" and st["block_size"] == 128
    assert st["query_heads"] > st["kv_heads"]  # GQA
    cases = {(c["dtype"], c["head_size"]): c for c in st["cases"]}
    assert set(cases) == {(d, h) for d in ("float32", "bfloat16") for h in (64, 96, 128)}
    for c in cases.values():
        assert c["status"] == "ok" and c["impl"] in ("cpu", "reference"), c
        assert c["max_abs_err"] <= c["tolerance"] * 2


def test_human_report_says_no_npu_plainly(run):
    _, data = run
    report = Report(
        {k: v for k, v in data.items() if k not in ("ok", "failures", "warnings")},
        data["failures"],
        data["warnings"],
    )
    text = doctor.format_report(report)
    assert "NPU:            none present" in text
    assert "self-test on cpu" in text and text.rstrip().endswith(")")
    assert "result: OK" in text


def test_a_stub_torch_npu_module_is_no_npu(monkeypatch):
    if _torch_npu_installed():
        pytest.skip("torch-npu is installed here")
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    info = doctor.probe_npu()
    assert info["present"] is False and "stub" in info["reason"]


def _fake_installed(versions: dict[str, str]):
    def installed(names):
        for n in names:
            if n in versions:
                return n, versions[n]
        return None

    return installed


def test_npu_version_mismatches_warn_and_a_wrong_vllm_fails(monkeypatch):
    monkeypatch.delenv("ASCEND_MEPIC_SKIP_VLLM_VERSION_CHECK", raising=False)
    monkeypatch.setattr(doctor, "cann_version", lambda: ("8.0.0", "test"))
    pinned = {"vllm": "0.30.0", "vllm-ascend": "0.30.0rc2", "torch": "2.10.0+cpu",
              "torch-npu": "2.10.0.post4", "triton-ascend": "3.2.2"}  # fmt: skip
    monkeypatch.setattr(doctor, "installed", _fake_installed({**pinned, "torch-npu": "2.9.0"}))
    report = Report()
    doctor.probe_versions(report, on_npu=True)
    status = {r["package"]: r["status"] for r in report.sections["versions"]}
    assert status["torch-npu"] == "warn" and status["CANN"] == "warn"
    assert status["torch"] == status["vllm-ascend"] == status["triton-ascend"] == "ok"
    assert report.failures == [] and len(report.warnings) == 2
    assert all("untested on hardware" in w for w in report.warnings)

    monkeypatch.setattr(doctor, "installed", _fake_installed({**pinned, "vllm": "0.31.0"}))
    report = Report()
    doctor.probe_versions(report, on_npu=True)
    assert len(report.failures) == 1 and "0.31.0" in report.failures[0]


def test_a_failing_self_test_is_reported_not_raised(monkeypatch):
    # Forcing the NPU composition on a CPU: its calls fail for want of torch_npu.
    monkeypatch.setenv("ASCEND_MEPIC_ATTN_IMPL", "npu")
    report = Report()
    doctor.run_selftest(report, "cpu", kernel_ok=False)
    cases = report.sections["self_test"]["cases"]
    assert cases and all(c["status"] == "fail" and c["impl"] == "npu" for c in cases)
    assert len(report.failures) == len(cases)


def test_failures_make_the_exit_status_nonzero(monkeypatch, capsys):
    failed = Report({"devices": {"npu": {"present": False, "reason": "no NPU: x"},
                                 "cuda": {"present": False},
                                 "cpu": {"machine": "x86_64", "isa": []}}},
                    failures=["something broke"])  # fmt: skip
    monkeypatch.setattr(doctor, "diagnose", lambda self_test=True: failed)
    args = doctor.doctor_parser().parse_args([])
    assert doctor.cmd_doctor(args) == 1
    out = capsys.readouterr().out
    assert "x something broke" in out and "result: FAIL" in out


def test_model_self_test_runs_at_the_models_attention_shape(tmp_path):
    """`doctor --model`: one case, at the config's head size, GQA and dtype (what the worker
    would launch for it); an unreadable config is a reported failure."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 480,
              "num_attention_heads": 6, "num_key_value_heads": 2, "intermediate_size": 64,
              "num_hidden_layers": 1, "vocab_size": 64, "torch_dtype": "float32"}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    report = Report()
    doctor.run_selftest(report, "cpu", kernel_ok=False, model=str(tmp_path))
    st = report.sections["self_test"]
    assert (st["query_heads"], st["kv_heads"], st["model"]) == (6, 2, str(tmp_path))
    (case,) = st["cases"]
    assert (case["head_size"], case["dtype"], case["status"]) == (80, "float32", "ok")
    assert not report.failures

    missing = Report()
    doctor.run_selftest(missing, "cpu", kernel_ok=False, model=str(tmp_path / "absent"))
    assert missing.failures and "cannot read" in missing.failures[0]
