"""The accuracy gate: a small eval set sent through the cluster and scored against the baseline.

kvctl's offline counterpart of the gsm8k accuracy test vLLM runs for P/D: each
item is a chat prompt with its accepted answers, written for this project so
that a 135M instruct model answers a measurable share of them (short facts,
one-step arithmetic, yes/no). verify sends every prompt through the cluster
as usual (P, then D) and asks the baseline (P, full generation) too; this
module scores both outputs (pure) and decides the gate:

    passed  <=>  P/D accuracy >= baseline accuracy - tolerance

`tolerance` is absolute (0.1: three items of thirty). On CPU P/D and the
baseline are token-equal, so the accuracies are equal; on GPU near-ties may
flip a few answers either way, which the tolerance absorbs, while KV that is
wrong (noise, another prompt's entry) costs many.

Scoring normalises both texts (lowercase, accents and punctuation gone, number
words as digits), then by kind:

    fact    an accepted answer appears in the output as whole words
    number  the number after the first `=`, `is` or `equals`, else the first number
    yesno   the first `yes` or `no` word in the output
"""

from __future__ import annotations

import json
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvctl.errors import BadInput

if TYPE_CHECKING:
    from kvctl.verify.report import VerifyReport

DEFAULT_TOLERANCE = 0.1  # absolute accuracy P/D may lose against the baseline
KINDS = ("fact", "number", "yesno")

_NUMBER_WORDS = {w: str(i) for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen twenty".split())}
_RESULT_NUMBER = re.compile(r"(?:=|\bis\b|\bequals\b|\bmakes\b)\s*(-?\d+)")
_ANY_NUMBER = re.compile(r"-?\d+")
_YESNO = re.compile(r"\b(yes|no)\b")


@dataclass(frozen=True)
class EvalItem:
    id: str
    kind: str  # one of KINDS
    prompt: str
    answers: tuple[str, ...]  # accepted answers (normalised on use)


@dataclass(frozen=True)
class EvalSet:
    name: str
    description: str
    items: tuple[EvalItem, ...]
    max_tokens: int = 16  # enough for a one-sentence answer

    @property
    def prompts(self) -> list[str]:
        return [i.prompt for i in self.items]


def _items(kind: str, suffix: str, rows: list[tuple[str, tuple[str, ...]]]) -> list[EvalItem]:
    return [EvalItem(f"{kind}-{n + 1:02d}", kind, f"{q} {suffix}", a) for n, (q, a) in enumerate(rows)]


_BASIC = (
    _items("fact", "Answer in one or two words.", [
        ("What is the capital of France?", ("paris",)), ("What is the capital of Japan?", ("tokyo",)),
        ("What is the capital of Italy?", ("rome",)), ("What is the capital of Germany?", ("berlin",)),
        ("What is the capital of Spain?", ("madrid",)), ("What is the capital of England?", ("london",)),
        ("What color is the sky on a clear day?", ("blue",)), ("How many legs does a spider have?", ("8",)),
        ("What is the opposite of hot?", ("cold",)), ("What gas do humans need to breathe?", ("oxygen",)),
        ("What is the chemical symbol for water?", ("h2o",)), ("What is the largest planet in our solar system?",
                                                               ("jupiter",)),
    ])
    + _items("number", "Answer with a number only.", [
        ("What is 2 + 3?", ("5",)), ("What is 4 + 4?", ("8",)), ("What is 10 - 3?", ("7",)),
        ("What is 3 times 3?", ("9",)), ("What is 9 - 4?", ("5",)), ("What is 2 times 6?", ("12",)),
        ("What is 12 + 8?", ("20",)), ("What is 7 + 2?", ("9",)), ("What is 5 + 5?", ("10",)),
        ("What is 20 divided by 4?", ("5",)),
    ])
    + _items("yesno", "Answer yes or no.", [
        ("Is the sun hot?", ("yes",)), ("Is Paris in France?", ("yes",)), ("Is water wet?", ("yes",)),
        ("Do cats have four legs?", ("yes",)), ("Can a car fly like a bird?", ("no",)),
        ("Is the moon made of cheese?", ("no",)), ("Is fire cold?", ("no",)), ("Is snow black?", ("no",)),
    ])
)

EVAL_SETS: dict[str, EvalSet] = {
    "basic": EvalSet("basic", "30 short facts, one-step sums and yes/no questions (chat prompts)",
                     tuple(_BASIC)),
}


def load_eval(name_or_file: str) -> EvalSet:
    """A built-in set by name, or a JSON file: {"name", "items": [{"id", "kind", "prompt",
    "answers": [...]}], "max_tokens"?}.

    Raises BadInput (field `eval`) for an unknown name, an unreadable file or a bad item.
    """
    if name_or_file in EVAL_SETS:
        return EVAL_SETS[name_or_file]
    path = Path(name_or_file).expanduser()
    if not path.is_file():
        raise BadInput(f"no eval set {name_or_file!r}", field="eval",
                       fix=f"use {', '.join(EVAL_SETS)} or a JSON file of items")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        items = tuple(EvalItem(str(i["id"]), str(i["kind"]), str(i["prompt"]),
                               tuple(str(a) for a in i["answers"])) for i in raw["items"])
        max_tokens = int(raw.get("max_tokens", 16))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BadInput(f"cannot read eval set {path}: {e!r}", field="eval",
                       fix='write {"name": ..., "items": [{"id", "kind", "prompt", "answers": [...]}]}') from None
    for item in items:
        if item.kind not in KINDS or not item.answers or not item.prompt.strip():
            raise BadInput(f"eval item {item.id!r}: kind must be one of {', '.join(KINDS)}, with a prompt "
                           f"and at least one answer", field="eval", fix="correct the item")
    if not items:
        raise BadInput(f"eval set {path} has no items", field="eval", fix="add items")
    return EvalSet(str(raw.get("name") or path.stem), str(raw.get("description", "")), items, max_tokens)


# ---- scoring (pure) --------------------------------------------------------------------------

def normalise(text: str) -> str:
    """Lowercase, accents and punctuation gone, whitespace collapsed, number words as digits."""
    text = unicodedata.normalize("NFKD", text.lower())
    text = "".join(c for c in text if not unicodedata.combining(c))
    text = re.sub(r"(?<=\d),(?=\d{3})", "", text)  # 1,000 -> 1000
    text = re.sub(r"[^a-z0-9=+\-*/ ]+", " ", text)
    words = [_NUMBER_WORDS.get(w, w) for w in text.split()]
    return " ".join(words)


def extract(kind: str, text: str) -> str | None:
    """The answer a model gave in `text` for an item of `kind` (normalised), or None."""
    norm = normalise(text)
    if kind == "number":
        found = _RESULT_NUMBER.search(norm) or _ANY_NUMBER.search(norm)
        return found.group(1 if found.re is _RESULT_NUMBER else 0) if found else None
    if kind == "yesno":
        found = _YESNO.search(norm)
        return found.group(1) if found else None
    return norm


def is_correct(item: EvalItem, text: str) -> bool:
    got = extract(item.kind, text)
    if got is None:
        return False
    accepted = [normalise(a) for a in item.answers]
    if item.kind == "fact":
        padded = f" {got} "
        return any(f" {a} " in padded for a in accepted)
    return got in accepted


@dataclass
class ItemScore:
    id: str
    kind: str
    expected: tuple[str, ...]
    pd_output: str
    baseline_output: str
    pd_correct: bool
    baseline_correct: bool

    @property
    def agree(self) -> bool:
        """P/D and the baseline are both right or both wrong on this item."""
        return self.pd_correct == self.baseline_correct

    def to_json(self) -> dict:
        return {"id": self.id, "kind": self.kind, "expected": list(self.expected),
                "pd_output": self.pd_output, "baseline_output": self.baseline_output,
                "pd_correct": self.pd_correct, "baseline_correct": self.baseline_correct,
                "agree": self.agree, "same_output": self.pd_output == self.baseline_output}


@dataclass
class EvalReport:
    name: str
    tolerance: float
    items: list[ItemScore] = field(default_factory=list)

    @property
    def pd_accuracy(self) -> float:
        return sum(i.pd_correct for i in self.items) / len(self.items) if self.items else 0.0

    @property
    def baseline_accuracy(self) -> float:
        return sum(i.baseline_correct for i in self.items) / len(self.items) if self.items else 0.0

    @property
    def agreement(self) -> float:
        """Share of items where P/D and the baseline are both right or both wrong."""
        return sum(i.agree for i in self.items) / len(self.items) if self.items else 0.0

    @property
    def passed(self) -> bool:
        # a hair of slack so 0.5 - 0.1 vs 0.4 is not lost to float rounding
        return bool(self.items) and self.pd_accuracy >= self.baseline_accuracy - self.tolerance - 1e-9

    def verdict(self) -> str:
        pd_n = sum(i.pd_correct for i in self.items)
        base_n = sum(i.baseline_correct for i in self.items)
        n = len(self.items)
        cmp = ">=" if self.passed else "<"
        return (f"eval {self.name}: P/D {pd_n}/{n} ({self.pd_accuracy:.0%}) {cmp} baseline {base_n}/{n} "
                f"({self.baseline_accuracy:.0%}) - tolerance {self.tolerance:g}; "
                f"agreement {sum(i.agree for i in self.items)}/{n}")

    def to_json(self) -> dict:
        return {"name": self.name, "passed": self.passed, "tolerance": self.tolerance,
                "pd_accuracy": round(self.pd_accuracy, 4),
                "baseline_accuracy": round(self.baseline_accuracy, 4),
                "agreement": round(self.agreement, 4), "items_total": len(self.items),
                "verdict": self.verdict(), "items": [i.to_json() for i in self.items]}


def score(eval_set: EvalSet, pd_outputs: list[str], baseline_outputs: list[str],
          tolerance: float = DEFAULT_TOLERANCE) -> EvalReport:
    """Score P/D's and the baseline's output of every item (in the set's order)."""
    if not 0 <= tolerance <= 1:
        raise BadInput(f"eval tolerance must be between 0 and 1, got {tolerance}", field="eval_tolerance",
                       fix=f"use {DEFAULT_TOLERANCE} (absolute accuracy)")
    if len(pd_outputs) != len(eval_set.items) or len(baseline_outputs) != len(eval_set.items):
        raise ValueError("one output per eval item is needed")
    return EvalReport(eval_set.name, tolerance, [
        ItemScore(item.id, item.kind, item.answers, pd, base, is_correct(item, pd), is_correct(item, base))
        for item, pd, base in zip(eval_set.items, pd_outputs, baseline_outputs)])


def score_report(eval_set: EvalSet, report: "VerifyReport", tolerance: float = DEFAULT_TOLERANCE) -> EvalReport:
    """Score a verify run over `eval_set.prompts` (one request per item, in order)."""
    return score(eval_set, [r.decode_output for r in report.requests],
                 [r.baseline_output for r in report.requests], tolerance)
