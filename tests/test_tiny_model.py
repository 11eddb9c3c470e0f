"""The random-weight Llama generator: determinism, tokenizer, weights, CLI, and a
real load + greedy generate with transformers in the CPU rig."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import textwrap
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from kvctl.provision import tiny_model as gen
from kvctl.cli import main
from kvctl.errors import BadInput
from kvctl.provision.tiny_model import PRESETS, SPECIAL_TOKENS, ensure_default_model, write_model

FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json", "special_tokens_map.json", gen.MARKER}
CPU_HEAD_SIZES = {32, 64, 80, 96, 112, 128, 192, 256}  # vLLM CPU attention
TEXTS = ["Hello, how are you today?", "café naïve über Straße, São Paulo",
         "你好世界，今天天气很好", "日本語のテキスト 한국어 привет мир καλημέρα",
         "emoji 🚀😀 and tabs\tand\nnewlines  double  spaces", "x1 = f(0.125);"]


def _contents(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in d.iterdir()}


def test_same_seed_gives_byte_identical_files_and_another_seed_other_weights(tmp_path: Path):
    a = write_model(tmp_path / "a", "tiny", seed=0)
    b = write_model(tmp_path / "b", "tiny", seed=0)
    c = write_model(tmp_path / "c", "tiny", seed=1)
    ca, cb, cc = _contents(a.path), _contents(b.path), _contents(c.path)
    assert set(ca) == FILES
    assert ca == cb
    assert a.created and b.created and a.num_params == c.num_params
    assert ca["model.safetensors"] != cc["model.safetensors"]
    assert ca["tokenizer.json"] == cc["tokenizer.json"]  # the tokenizer does not depend on seed
    assert json.loads(cc[gen.MARKER])["seed"] == 1
    assert a.total_bytes == sum(len(v) for v in ca.values())


def test_existing_model_is_reused_and_another_kvctl_model_replaced(tmp_path: Path, monkeypatch):
    out = tmp_path / "m"
    first = write_model(out)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    again = write_model(out)
    assert again == dataclasses.replace(first, created=False)
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    other = write_model(out, seed=5)
    assert other.created and json.loads((out / gen.MARKER).read_text())["seed"] == 5
    assert _contents(out) == _contents(write_model(tmp_path / "ref", seed=5).path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "ref"]  # no temp dirs left
    monkeypatch.setitem(gen.PRESETS, "tiny", dataclasses.replace(gen.PRESETS["tiny"], layers=1))
    resized = write_model(out, seed=5)  # same preset name, new sizes: rebuilt
    assert resized.created and resized.num_params < other.num_params


def test_empty_folder_is_filled(tmp_path: Path):
    (tmp_path / "empty").mkdir()
    assert set(_contents(write_model(tmp_path / "empty").path)) == FILES


@pytest.mark.parametrize("setup, what", [
    (lambda d: (d.mkdir(), (d / "notes.txt").write_text("mine")), "not empty"),
    (lambda d: d.write_text("a file"), "is a file"),
])
def test_foreign_out_is_refused_and_untouched(tmp_path: Path, setup, what):
    out = tmp_path / "out"
    setup(out)
    before = _contents(out) if out.is_dir() else out.read_bytes()
    with pytest.raises(BadInput, match=what) as e:
        write_model(out)
    assert e.value.fix and e.value.fields == ("out",)
    assert (_contents(out) if out.is_dir() else out.read_bytes()) == before


def test_bad_preset_and_seed(tmp_path: Path):
    with pytest.raises(BadInput, match="unknown model preset 'huge'") as e:
        write_model(tmp_path / "x", "huge")
    assert "tiny" in e.value.fix and "bench" in e.value.fix
    with pytest.raises(BadInput, match="seed"):
        write_model(tmp_path / "x", seed=-1)
    assert not (tmp_path / "x").exists()


def test_crash_while_writing_leaves_nothing_that_looks_complete(tmp_path: Path, monkeypatch):
    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(gen, "_write_weights", boom)
    with pytest.raises(OSError, match="disk full"):
        write_model(tmp_path / "m")
    assert list(tmp_path.iterdir()) == []  # neither the model nor its temp dir


def test_weights_match_config_and_specials_are_never_greedy(tmp_path: Path):
    info = write_model(tmp_path / "m")
    cfg = json.loads((info.path / "config.json").read_text())
    w = load_file(str(info.path / "model.safetensors"))
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["torch_dtype"] == "float32"
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["head_dim"]) == (128, 2, 4, 2, 32)
    assert w["model.embed_tokens.weight"].shape == (cfg["vocab_size"], 128)
    assert w["model.layers.1.self_attn.k_proj.weight"].shape == (2 * 32, 128)
    assert sum(a.size for a in w.values()) == info.num_params
    assert all(a.dtype == np.float32 and np.isfinite(a).all() for a in w.values())
    q = w["model.layers.0.self_attn.q_proj.weight"]
    assert 0.5 / np.sqrt(128) < q.std() < 2 / np.sqrt(128)  # scaled init, not all zeros/ones
    vocab = json.loads((info.path / "tokenizer.json").read_text())["model"]["vocab"]
    special = [vocab[t] for t in SPECIAL_TOKENS]
    head = w["lm_head.weight"]
    assert not head[special].any() and (np.abs(head).sum(axis=1) > 0).sum() == len(vocab) - len(special)
    assert cfg["vocab_size"] == len(vocab)
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (
        vocab["<s>"], vocab["</s>"], vocab["<pad>"])


def test_tokenizer_round_trips_ascii_and_non_ascii(tmp_path: Path):
    tok = Tokenizer.from_file(str(write_model(tmp_path / "m").path / "tokenizer.json"))
    for text in TEXTS:
        enc = tok.encode(text)
        assert enc.ids[0] == tok.token_to_id("<s>")  # completions get one bos
        assert tok.decode(enc.ids) == text  # bos skipped as a special token
    # Trained on CJK/accented text: common words are merged, not left as raw bytes.
    for word in ("你好世界", "Straße", "привет"):
        assert len(tok.encode(word, add_special_tokens=False).ids) < len(word.encode()) / 2
    # Role markers are single special tokens.
    ids = tok.encode("<|user|>\nhi<|end|>", add_special_tokens=False).ids
    assert ids[0] == tok.token_to_id("<|user|>") and ids[-1] == tok.token_to_id("<|end|>")


def test_presets_fit_vllm_cpu_and_bench_size_is_bounded():
    for p in PRESETS.values():
        assert p.head_dim in CPU_HEAD_SIZES and p.heads % p.kv_heads == 0
    shapes = gen._tensor_shapes(PRESETS["bench"], 2048)
    params = sum(int(np.prod(s)) for s in shapes.values())
    assert 100e6 < params * 4 < 1.5e9


def test_cli_writes_model_and_reports_json(tmp_path: Path, capsys):
    assert main(["model", "tiny", "--out", str(tmp_path / "m"), "--seed", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["path"] == str(tmp_path / "m") and report["seed"] == 2 and report["created"]
    assert report["num_params"] == 819840 and report["total_bytes"] > 3_000_000
    assert main(["model", "tiny", "--out", str(tmp_path / "m"), "--seed", "2"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == str(tmp_path / "m") and "already there" in captured.err


def test_cli_refuses_foreign_folder_with_exit_2(tmp_path: Path, capsys):
    (tmp_path / "keep.txt").write_text("x")
    assert main(["model", "bench", "--out", str(tmp_path), "--json"]) == 2
    report = json.loads(capsys.readouterr().out)
    assert "holds no kvctl-generated model" in report["error"] and report["fix"]
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_ensure_default_model_writes_under_kvctl_home(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("KVCTL_HOME", str(tmp_path / "home"))
    path = ensure_default_model()
    assert path == tmp_path / "home" / "models" / "tiny-llama"
    assert set(_contents(path)) == FILES
    assert ensure_default_model() == path


RIG_CHECK = textwrap.dedent("""
    import json, sys
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM
    path, texts = sys.argv[1], json.loads(sys.argv[2])
    tok = AutoTokenizer.from_pretrained(path)
    model = LlamaForCausalLM.from_pretrained(path).eval()
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Tell me about the café in 東京."},
            {"role": "assistant", "content": "It is nice."},
            {"role": "user", "content": "Why?"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=10, do_sample=False)
    print(json.dumps({
        "tokenizer": type(tok).__name__,
        "specials": [tok.bos_token, tok.eos_token, tok.pad_token],
        "special_ids": tok.all_special_ids,
        "rendered": tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
        "rendered_no_prompt": tok.apply_chat_template(msgs, tokenize=False),
        "round_trip": [tok.decode(tok(t)["input_ids"], skip_special_tokens=True) for t in texts],
        "new_tokens": out[0, ids.shape[1]:].tolist(),
    }))
""")


def test_rig_transformers_loads_model_and_greedy_output_varies(rig_python: Path, tiny_model: Path):
    p = subprocess.run([str(rig_python), "-c", RIG_CHECK, str(tiny_model), json.dumps(TEXTS)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["tokenizer"] == "PreTrainedTokenizerFast"
    assert r["specials"] == ["<s>", "</s>", "<pad>"]
    assert r["rendered"] == ("<s><|system|>\nBe brief.<|end|>\n"
                             "<|user|>\nTell me about the café in 東京.<|end|>\n"
                             "<|assistant|>\nIt is nice.<|end|>\n"
                             "<|user|>\nWhy?<|end|>\n<|assistant|>\n")
    assert r["rendered_no_prompt"] + "<|assistant|>\n" == r["rendered"]
    assert r["round_trip"] == TEXTS
    new = r["new_tokens"]
    assert len(new) == 10 and len(set(new)) > 1, new
    assert not set(new) & set(r["special_ids"])  # never stops early, never emits a marker
