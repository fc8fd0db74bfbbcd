"""Tests for ascend_mepic.eval.prepare: local model folders for tests, benchmarks, the demo."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ascend_mepic.eval import prepare
from ascend_mepic.eval.prepare import (
    MARKER,
    cache_dir,
    prepare_smollm2,
    prepare_tiny_llama,
    resolve_model,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama")


def test_cache_dir_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ASCEND_MEPIC_CACHE", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("ASCEND_MEPIC_CACHE")
    assert cache_dir() == tmp_path / "xdg" / "ascend_mepic"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == Path.home() / ".cache" / "ascend_mepic"


def test_tiny_folder_is_complete(tiny: Path) -> None:
    names = {p.name for p in tiny.iterdir()}
    assert {MARKER, "config.json", "model.safetensors", "tokenizer.json"} <= names
    assert not list(tiny.parent.glob(f".{tiny.name}.partial-*"))
    config = json.loads((tiny / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["vocab_size"] == 512
    assert config["hidden_size"] // config["num_attention_heads"] >= 32  # vLLM CPU minimum


def test_tiny_is_idempotent(tiny: Path) -> None:
    before = (tiny / MARKER).stat().st_mtime_ns
    assert prepare_tiny_llama(tiny) == tiny
    assert (tiny / MARKER).stat().st_mtime_ns == before


def test_rebuilds_partial_folder_and_on_force(tmp_path: Path) -> None:
    dest = tmp_path / "tiny"
    dest.mkdir()
    (dest / "junk").write_text("left by an interrupted build")
    prepare_tiny_llama(dest)
    assert (dest / MARKER).is_file()
    assert not (dest / "junk").exists()
    (dest / "junk").write_text("x")
    prepare_tiny_llama(dest, force=True)
    assert (dest / MARKER).is_file()
    assert not (dest / "junk").exists()


def test_tiny_weights_are_deterministic(tiny: Path, tmp_path: Path) -> None:
    torch.manual_seed(1234)  # the caller's RNG state must not matter
    other = prepare_tiny_llama(tmp_path / "again")
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (other / name).read_bytes() == (tiny / name).read_bytes(), name


def test_tiny_tokenizer_bos(tiny: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny)
    assert len(tok) == 512
    assert tok.convert_ids_to_tokens([tok.bos_token_id, tok.eos_token_id, tok.pad_token_id]) == [
        "<s>",
        "</s>",
        "<pad>",
    ]
    text = "The quick fox crosses the old bridge."
    with_special = tok.encode(text)
    without = tok.encode(text, add_special_tokens=False)
    assert with_special == [tok.bos_token_id, *without]
    assert tok.bos_token_id not in without
    assert tok.decode(without) == text


def test_tiny_chat_template(tiny: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny)
    messages = [{"role": "user", "content": "Hello there"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.convert_tokens_to_ids("<|im_end|>") in ids


def test_tiny_loads_with_transformers(tiny: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny)
    model = AutoModelForCausalLM.from_pretrained(tiny)
    assert model.dtype == torch.float32
    inputs = tok("A small dog sees the river", return_tensors="pt")
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (1, inputs["input_ids"].shape[1], 512)
    assert torch.isfinite(logits).all()


def test_resolve_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny: Path) -> None:
    monkeypatch.setenv("ASCEND_MEPIC_CACHE", str(tmp_path / "cache"))
    built = resolve_model("tiny")
    assert built == tmp_path / "cache" / "models" / "tiny-llama"
    assert resolve_model("tiny-llama") == built
    assert resolve_model(str(tiny)) == tiny
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        resolve_model(str(tmp_path / "no-such-model"))


def test_smollm2(tmp_path: Path) -> None:
    try:
        prepare.smollm2_gguf_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    dest = prepare_smollm2(tmp_path / "smollm2")
    assert (dest / MARKER).is_file()
    assert "Apache-2.0" in (dest / "LICENSE_NOTE.txt").read_text()
    assert "quantization_config" not in json.loads((dest / "config.json").read_text())
    assert getattr(AutoConfig.from_pretrained(dest), "quantization_config", None) is None

    tok = AutoTokenizer.from_pretrained(dest)
    assert tok.chat_template
    model = AutoModelForCausalLM.from_pretrained(dest)
    inputs = tok("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    text = tok.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert text.strip()
    assert "Paris" in text
