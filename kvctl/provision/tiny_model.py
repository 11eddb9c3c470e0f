"""Deterministic random-weight Llama models, generated offline (no model hub).

`write_model(dir, preset, seed)` writes a Hugging Face-format Llama folder
that vLLM and transformers load as-is:

    config.json               LlamaForCausalLM, sizes from PRESETS
    generation_config.json    bos/eos/pad ids only
    model.safetensors         random weights (numpy RNG, one stream per tensor)
    tokenizer.json            byte-level BPE trained here on generated text
    tokenizer_config.json     PreTrainedTokenizerFast, bos/eos/pad, chat template
    special_tokens_map.json
    kvctl-model.json          marker: generator, version, preset, seed, sizes

Same preset + seed + GENERATOR_VERSION gives byte-identical files. The folder
is built beside its destination and renamed into place, so a folder with the
marker is always complete. Only numpy, safetensors and `tokenizers` are used:
kvctl builds models without torch or vLLM.

Greedy decoding never picks a special token (their output rows are zero, so
their logit is 0 while the best ordinary logit is well above 0): generations
always run to max_tokens and never end early on </s>.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import tempfile
import zlib
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from kvctl.errors import BadInput
from kvctl.paths import kvctl_home

log = logging.getLogger(__name__)

# Bump when the output of a preset changes (other than its PRESETS sizes): a
# folder with an older marker is rebuilt.
GENERATOR_VERSION = 1
MARKER = "kvctl-model.json"
WEIGHTS = "model.safetensors"

TOKENIZER_VOCAB = 2048  # target BPE vocab, specials included
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
PAD, BOS, EOS = SPECIAL_TOKENS[:3]
ROLE_TOKENS = SPECIAL_TOKENS[3:]
TOKENIZER_TEXT_SEED = 20240611  # the training text never depends on the model seed

CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class Preset:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int  # vLLM CPU attention: 32, 64, 80, 96, 112, 128, 192, 256
    intermediate: int
    max_positions: int = 4096
    # float32 on every preset: exact, greedy ties are rarer than in bf16, and
    # its CPU speed does not hinge on AMX/avx512_bf16 the way bf16's does.
    # Servers can still load it as bf16 (--dtype bfloat16).
    dtype: str = "float32"


PRESETS: dict[str, Preset] = {
    "tiny": Preset(hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32,
                   intermediate=256),
    # ~287M params, ~1.15 GB: a 2k-token prefill takes ~2 s on 2 idle cores (vLLM
    # V0 CPU, float32), more when the machine is busy. 96 KiB of KV per token,
    # the order of an 8B GQA model in bf16 (128 KiB).
    "bench": Preset(hidden=1024, layers=24, heads=16, kv_heads=8, head_dim=64,
                    intermediate=2816),
}


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    preset: str
    seed: int
    dtype: str
    num_params: int
    total_bytes: int  # all files in the folder
    vocab_size: int
    generator_version: int
    created: bool  # False when an identical model was already there

    def to_json(self) -> dict:
        d = asdict(self)
        d["path"] = str(self.path)
        return d


# ---------------------------------------------------------------- tokenizer

_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have "
    "from or one had by word but not what all were we when your can said there use an "
    "each which she do how their if will up other about out many then them these so some "
    "her would make like him into time has look two more write go see number no way could "
    "people my than first water been call who oil its now find long down day did get come "
    "made may part hello world please tell me story about cache prefill decode token model "
    "server request response store transfer key value layer head vector memory disk file "
    "question answer explain why because system user assistant quick brown fox jumps over "
    "lazy dog summary paragraph sentence weather today tomorrow yesterday city country"
).split()
_NON_ASCII = (
    "café naïve résumé über Straße niño façade déjà vu señor crème brûlée Ångström "
    "smörgåsbord jalapeño coöperate Zürich São Paulo Kraków Łódź İstanbul "
    "καλημέρα κόσμε αλφάβητο привет мир спасибо здравствуйте "
    "你好 世界 你好世界 中文 文本 模型 缓存 预填充 解码 我们 今天 天气 很好 "
    "日本語 のテキスト こんにちは ありがとう 東京 カタカナ ひらがな "
    "한국어 안녕하세요 감사합니다 مرحبا שלום नमस्ते ☕ 🚀 😀 ✓ € £ ¥ — … « » “ ” ‘ ’"
).split()
_SYLLABLES = ("ka", "lo", "mi", "ter", "on", "ra", "ve", "st", "ing", "ex", "pre", "ion",
              "al", "ou", "th", "er", "an", "qu", "is", "ne", "ch", "ur", "ed", "ly")


def _training_text(rng: random.Random) -> list[str]:
    """Deterministic lines of English-ish, non-ASCII, numeric and code-like text."""
    made_up = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4)))
               for _ in range(400)]
    lines = []
    for i in range(6000):
        kind = i % 6
        if kind == 5:
            words = [rng.choice(_NON_ASCII) for _ in range(rng.randint(3, 10))]
        elif kind == 4:
            words = [f"{rng.choice(_WORDS)}_{rng.randint(0, 99)} = {rng.randint(0, 9999)};",
                     f"x{rng.randint(0, 9)}.{rng.choice(_WORDS)}({rng.random():.3f})"]
        else:
            pool = made_up if kind == 3 else _WORDS
            words = [rng.choice(pool) for _ in range(rng.randint(4, 16))]
            if rng.random() < 0.3:
                words[0] = words[0].capitalize()
            words[-1] += rng.choice((".", ",", "?", "!", ":"))
        lines.append(" ".join(words))
    return lines


@lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    """tokenizer.json text; depends only on GENERATOR_VERSION, so it is cached."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB, min_frequency=2, show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_training_text(random.Random(TOKENIZER_TEXT_SEED)), trainer=trainer)
    # Completions (add_special_tokens=True) get one <s>; chat prompts carry it
    # in the template and are tokenized without specials.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, tok.token_to_id(BOS))])
    return tok.to_str()


def _tokenizer_files(model_max_length: int) -> tuple[dict[str, str], int]:
    """The three tokenizer files' text and the vocab size."""
    tok_json = _tokenizer_json()
    vocab = json.loads(tok_json)["model"]["vocab"]
    ids = {t: vocab[t] for t in SPECIAL_TOKENS}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": None,
        "additional_special_tokens": list(ROLE_TOKENS),
        "added_tokens_decoder": {
            str(ids[t]): {"content": t, "lstrip": False, "normalized": False,
                          "rstrip": False, "single_word": False, "special": True}
            for t in SPECIAL_TOKENS},
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    special_map = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
                   "additional_special_tokens": list(ROLE_TOKENS)}
    return ({"tokenizer.json": tok_json,
             "tokenizer_config.json": _dumps(config),
             "special_tokens_map.json": _dumps(special_map)},
            len(vocab))


# ------------------------------------------------------------------ weights

def _tensor_shapes(p: Preset, vocab: int) -> dict[str, tuple[int, ...]]:
    shapes = {"model.embed_tokens.weight": (vocab, p.hidden),
              "model.norm.weight": (p.hidden,),
              "lm_head.weight": (vocab, p.hidden)}
    q, kv = p.heads * p.head_dim, p.kv_heads * p.head_dim
    for i in range(p.layers):
        pre = f"model.layers.{i}."
        shapes.update({
            pre + "input_layernorm.weight": (p.hidden,),
            pre + "post_attention_layernorm.weight": (p.hidden,),
            pre + "self_attn.q_proj.weight": (q, p.hidden),
            pre + "self_attn.k_proj.weight": (kv, p.hidden),
            pre + "self_attn.v_proj.weight": (kv, p.hidden),
            pre + "self_attn.o_proj.weight": (p.hidden, q),
            pre + "mlp.gate_proj.weight": (p.intermediate, p.hidden),
            pre + "mlp.up_proj.weight": (p.intermediate, p.hidden),
            pre + "mlp.down_proj.weight": (p.hidden, p.intermediate),
        })
    return shapes


def _tensor_values(name: str, shape: tuple[int, ...], seed: int,
                   special_ids: list[int]) -> np.ndarray:
    """One tensor, from its own RNG stream (seed, name): order-independent.

    Uniform values with unit-ish variance for embeddings and 1/sqrt(fan_in)
    scale for projections keep activations O(1) through the layers, so the
    next token depends on the context, not only on the last token.
    `Generator.random` is plain bit arithmetic, stable across numpy versions.
    """
    if name.endswith("norm.weight"):
        return np.ones(shape, dtype=np.float32)
    rng = np.random.Generator(np.random.PCG64([seed, zlib.crc32(name.encode())]))
    scale = 1.0 if name == "model.embed_tokens.weight" else 1.0 / np.sqrt(shape[-1])
    # uniform(-a, a) has std a/sqrt(3)
    values = (rng.random(shape, dtype=np.float32) * 2.0 - 1.0) * np.float32(scale * np.sqrt(3.0))
    if name == "lm_head.weight":
        values[special_ids] = 0.0  # greedy never emits a special token
    return values


def _write_weights(path: Path, shapes: dict[str, tuple[int, ...]], seed: int,
                   special_ids: list[int]) -> None:
    from safetensors.numpy import save_file

    tensors = {name: _tensor_values(name, shape, seed, special_ids)
               for name, shape in sorted(shapes.items())}
    save_file(tensors, str(path), metadata={"format": "pt"})  # transformers wants "format"
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


# ------------------------------------------------------------------- folder

def _dumps(obj: dict) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def _config(p: Preset, vocab: int, ids: dict[str, int]) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": p.hidden, "intermediate_size": p.intermediate,
        "num_hidden_layers": p.layers, "num_attention_heads": p.heads,
        "num_key_value_heads": p.kv_heads, "head_dim": p.head_dim,
        "vocab_size": vocab, "max_position_embeddings": p.max_positions,
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0,
        "mlp_bias": False, "pretraining_tp": 1, "initializer_range": 0.02,
        "tie_word_embeddings": False, "use_cache": True, "torch_dtype": p.dtype,
        "bos_token_id": ids[BOS], "eos_token_id": ids[EOS], "pad_token_id": ids[PAD],
    }


def _write_text(path: Path, text: str) -> None:
    # fsync before the folder's rename, so a crash cannot publish empty files
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _read_marker(path: Path) -> dict | None:
    try:
        return json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None


def _matches(marker: dict | None, preset: str, seed: int) -> bool:
    # The preset's sizes are compared too: editing PRESETS rebuilds old folders.
    return bool(marker) and marker.get("generator") == "kvctl" and (
        marker.get("version"), marker.get("preset"), marker.get("seed"),
        marker.get("sizes")) == (GENERATOR_VERSION, preset, seed, asdict(PRESETS[preset]))


def _info(path: Path, marker: dict, created: bool) -> ModelInfo:
    return ModelInfo(path=path, preset=marker["preset"], seed=marker["seed"],
                     dtype=marker["dtype"], num_params=marker["num_params"],
                     total_bytes=sum(f.stat().st_size for f in path.iterdir()),
                     vocab_size=marker["vocab_size"],
                     generator_version=marker["version"], created=created)


def _build(tmp: Path, preset: str, seed: int) -> dict:
    """Write every file into `tmp`; return the marker (written last)."""
    p = PRESETS[preset]
    tok_files, vocab = _tokenizer_files(p.max_positions)
    vocab_map = json.loads(tok_files["tokenizer.json"])["model"]["vocab"]
    ids = {t: vocab_map[t] for t in SPECIAL_TOKENS}
    shapes = _tensor_shapes(p, vocab)
    files = dict(tok_files)
    files["config.json"] = _dumps(_config(p, vocab, ids))
    files["generation_config.json"] = _dumps(
        {"bos_token_id": ids[BOS], "eos_token_id": ids[EOS], "pad_token_id": ids[PAD]})
    for name, text in files.items():
        _write_text(tmp / name, text)
    _write_weights(tmp / WEIGHTS, shapes, seed, sorted(ids.values()))
    marker = {"generator": "kvctl", "version": GENERATOR_VERSION, "preset": preset,
              "seed": seed, "sizes": asdict(p), "dtype": p.dtype, "vocab_size": vocab,
              "num_params": sum(int(np.prod(s)) for s in shapes.values())}
    _write_text(tmp / MARKER, _dumps(marker))
    return marker


def write_model(out_dir: Path, preset: str = "tiny", seed: int = 0) -> ModelInfo:
    """Write the `preset` model with weights from `seed` into `out_dir`.

    Returns at once if `out_dir` already holds this preset + seed + generator
    version. A folder holding another kvctl-generated model is replaced (it
    can always be regenerated); anything else is left alone.

    Raises BadInput for an unknown preset, a negative seed (field `seed`), or
    an `out_dir` that is a file or a non-empty folder not made by this
    generator (field `out`).
    """
    if preset not in PRESETS:
        raise BadInput(f"unknown model preset {preset!r}", where="preset",
                       fix=f"use one of: {', '.join(PRESETS)}")
    if seed < 0:
        raise BadInput(f"seed must be >= 0, got {seed}", field="seed", fix="pass a seed of 0 or more")
    out_dir = Path(out_dir).absolute()
    marker = _read_marker(out_dir)
    if _matches(marker, preset, seed):
        return _info(out_dir, marker, created=False)
    if out_dir.exists() and not out_dir.is_dir():
        raise BadInput(f"{out_dir} is a file, not a folder", field="out",
                       fix="pass a new or empty folder")
    if out_dir.is_dir() and marker is None and any(out_dir.iterdir()):
        raise BadInput(f"{out_dir} is not empty and holds no kvctl-generated model",
                       field="out", fix="pass a new or empty folder, or delete this one")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        log.info("writing %s model (seed %d) to %s", preset, seed, out_dir)
        new_marker = _build(tmp, preset, seed)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        _publish(tmp, out_dir, preset, seed)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    done = _read_marker(out_dir)
    if not _matches(done, preset, seed):  # someone else published something else meanwhile
        raise BadInput(f"{out_dir} changed while the model was being written",
                       field="out", fix="run the command again")
    return _info(out_dir, done, created=done == new_marker)


def _publish(tmp: Path, out_dir: Path, preset: str, seed: int) -> None:
    """Rename `tmp` to `out_dir`; a racing writer of the same model wins harmlessly."""
    if out_dir.is_dir() and _read_marker(out_dir) is not None:
        # An older kvctl model: move it aside first (rename only replaces empty folders).
        if _matches(_read_marker(out_dir), preset, seed):
            return
        trash = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        try:
            os.rename(out_dir, trash / "model")
        except FileNotFoundError:
            pass
    else:
        trash = None
    try:
        os.rename(tmp, out_dir)  # atomic; replaces an empty folder
    except OSError:
        if not _matches(_read_marker(out_dir), preset, seed):
            raise
    finally:
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)


def default_model_dir(preset: str = "tiny") -> Path:
    return kvctl_home() / "models" / f"{preset}-llama"


def ensure_default_model(preset: str = "tiny") -> Path:
    """The preset's model under $KVCTL_HOME/models, written on first use (seed 0)."""
    return write_model(default_model_dir(preset), preset, seed=0).path
