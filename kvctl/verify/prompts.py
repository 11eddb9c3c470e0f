"""The prompts verify sends: the defaults, a prompts file, and the check that none is empty."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from kvctl.errors import BadInput

_LONG_SENTENCES = (
    "The prefill server reads the whole prompt once and writes its key value cache to the store.",
    "Then the decode server loads that cache from disk and starts to generate the answer at once.",
    "Please tell me a long story about a quick brown fox who jumps over the lazy dog every day.",
    "Each layer has a key and a value for every token, so the file grows with the prompt length.",
    "If the cache is missing or corrupt, the decode server must compute the prefill by itself.",
)
# Short, the seed's repeated prompt, long (~1000+ tokens on the tiny model), non-ASCII.
DEFAULT_PROMPTS: tuple[str, ...] = (
    "Hello, how are you?",
    "Hello, how are you?" * 67,
    " ".join(f"({i}) {_LONG_SENTENCES[i % len(_LONG_SENTENCES)]}" for i in range(36)),
    "Grüße aus Zürich! Привет, мир. 你好世界，今天天气很好。東京でこんにちは 🚀 — café, naïve, señor.",
)


def check_prompts(prompts: Iterable[str], where: str = "prompts") -> list[str]:
    """The prompts as a list, or BadInput naming the empty one.

    `where` names the list in the error (`prompts[1]`); a front end passes
    its own name for it, e.g. a scenario's `$.prompts`.
    """
    out = list(prompts)
    if not out:
        raise BadInput("no prompts to verify", field="prompts", fix="give at least one prompt")
    for i, p in enumerate(out):
        if not isinstance(p, str) or not p.strip():
            raise BadInput(f"prompt {i + 1} is empty", where=f"{where}[{i}]", fix="give every prompt some text")
    return out


def load_prompts_file(path: Path | str) -> list[str]:
    """Prompts from a file: a JSON list of strings, or one prompt per non-blank line.

    Raises BadInput for an unreadable file, bad JSON or an empty prompt list.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"cannot read prompts file: {e}", where=str(path),
                       fix="pass a readable UTF-8 file: a JSON list of strings or one prompt per line") from None
    if path.suffix == ".json" or text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except ValueError as e:
            raise BadInput(f"prompts file is not valid JSON: {e}", where=str(path),
                           fix='write a JSON list of strings, e.g. ["Hello", "Tell me a story"]') from None
        if not isinstance(data, list) or not all(isinstance(p, str) for p in data):
            raise BadInput("prompts file must hold a JSON list of strings", where=str(path),
                           fix='write e.g. ["Hello", "Tell me a story"]')
        prompts = data
    else:
        prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise BadInput("no prompts to verify", where=str(path), fix="give at least one prompt")
    return check_prompts(prompts, where=f"{path}: prompts")
