"""Convert a GGUF file into a plain Hugging Face directory (runs in the rig's python).

    python convert_gguf.py GGUF_FILE OUT_DIR DTYPE

transformers dequantizes the GGUF (tokenizer and weights) and `save_pretrained`
writes config, safetensors, tokenizer and chat template into OUT_DIR. It also
copies the GGUF in as `tokenizer.model`, which nothing reads (the tokenizer is
tokenizer.json): that copy and any other GGUF go. The result is then loaded
back from OUT_DIR alone (config, tokenizer, chat template) so a directory that
would not serve is never reported as converted. Prints one JSON line: the
files written and the versions that did the conversion.

kvctl runs it by path with accelerate on PYTHONPATH; it imports nothing of kvctl.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# Written by save_pretrained but not part of a plain HF directory kvctl serves.
LEFTOVERS = ("tokenizer.model",)


def convert(gguf: Path, out: Path, dtype: str) -> dict:
    import accelerate
    import gguf as gguf_pkg
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, dtype)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 torch_dtype=torch_dtype)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    _plain_tokenizer_class(out / "tokenizer_config.json")
    for name in LEFTOVERS:
        (out / name).unlink(missing_ok=True)
    for stray in out.glob("*.gguf"):
        stray.unlink()
    # Load back from the directory alone: what vLLM will read.
    config = transformers.AutoConfig.from_pretrained(out)
    back = AutoTokenizer.from_pretrained(out)
    prompt = back.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                      add_generation_prompt=True)
    if not prompt or not back.encode(prompt):
        raise SystemExit(f"the converted tokenizer in {out} renders no chat prompt")
    sample = "Hello world, Paris"
    if sample not in back.decode(back.encode(sample, add_special_tokens=False)):
        raise SystemExit(f"the converted tokenizer in {out} does not round-trip {sample!r}")
    return {"files": {p.name: p.stat().st_size for p in sorted(out.iterdir())},
            "architecture": (config.architectures or [None])[0],
            "layers": config.num_hidden_layers, "kv_heads": config.num_key_value_heads,
            "head_dim": getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
            "vocab_size": config.vocab_size,
            "num_params": sum(p.numel() for p in model.parameters()),
            "converted_with": {"transformers": transformers.__version__, "torch": torch.__version__,
                               "gguf": getattr(gguf_pkg, "__version__", None) or _dist_version("gguf"),
                               "accelerate": accelerate.__version__}}


def _plain_tokenizer_class(path: Path) -> None:
    """Name the tokenizer class that reads tokenizer.json as it is.

    The GGUF loader writes `LlamaTokenizer`; for this byte-level BPE, newer
    transformers (vLLM 0.32's) then rebuild its pre-tokenizer and decoder the
    sentencepiece way and mangle every space. PreTrainedTokenizerFast takes
    tokenizer.json whole, in every version.
    """
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _dist_version(name: str) -> str | None:
    import importlib.metadata as md

    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


if __name__ == "__main__":
    src, dst, dtype_name = sys.argv[1:4]
    print(json.dumps(convert(Path(src), Path(dst), dtype_name)))
