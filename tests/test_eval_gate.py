"""The accuracy gate's scorer and verdict (pure), the eval set, and its CLI/scenario inputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import Kvctl
from kvctl.errors import BadInput
from kvctl.scenario.schema import Scenario, check_scenario
from kvctl.verify import evals
from kvctl.verify.evals import EVAL_SETS, EvalItem, extract, is_correct, load_eval, normalise, score


def item(kind: str, *answers: str) -> EvalItem:
    return EvalItem("x", kind, "q", answers)


def test_the_basic_set_has_every_kind_and_unique_ids():
    basic = EVAL_SETS["basic"]
    assert len(basic.items) == 30
    assert {i.kind for i in basic.items} == set(evals.KINDS)
    assert len({i.id for i in basic.items}) == 30 and len(set(basic.prompts)) == 30


@pytest.mark.parametrize("text,expected", [
    ("The capital of France is Paris.", "the capital of france is paris"),
    ("Ça fait TWO, non?", "ca fait 2 non"),
    ("It costs 1,000 dollars.", "it costs 1000 dollars"),
])
def test_normalise(text, expected):
    assert normalise(text) == expected


@pytest.mark.parametrize("text,expected", [
    ("2 + 3 = 5", "5"), ("3 times 3 is 9.", "9"), ("The answer is 6.", "6"),
    ("20 divided by 4 equals 4 with a remainder of 2.", "4"), ("Seven.", "7"), ("no idea", None),
])
def test_number_answer_is_the_result_not_an_operand(text, expected):
    assert extract("number", text) == expected


def test_scoring_by_kind():
    assert is_correct(item("fact", "paris"), "The capital of France is Paris.")
    assert not is_correct(item("fact", "paris"), "Parisian food is great")  # whole words only
    assert is_correct(item("fact", "8"), "A spider has eight legs.")
    assert is_correct(item("yesno", "no"), "No, the moon is not made of cheese. Yes, really.")
    assert not is_correct(item("yesno", "yes"), "No, the sun is not hot.")
    assert not is_correct(item("yesno", "yes"), "It is hot.")  # no yes/no word at all
    assert not is_correct(item("number", "8"), "4 + 4 = 10")


def test_gate_passes_within_tolerance_and_fails_below():
    s = evals.EvalSet("t", "", tuple(EvalItem(f"i{n}", "fact", "q", ("yes",)) for n in range(10)))
    right, wrong = "yes", "nope"
    base = [right] * 6 + [wrong] * 4
    same = score(s, base, base, tolerance=0.1)
    assert same.passed and same.pd_accuracy == same.baseline_accuracy == 0.6 and same.agreement == 1.0
    one_less = score(s, [wrong] + base[1:], base, tolerance=0.1)  # 0.5 >= 0.6 - 0.1
    assert one_less.passed and one_less.agreement == 0.9
    two_less = score(s, [wrong, wrong] + base[2:], base, tolerance=0.1)  # 0.4 < 0.5
    assert not two_less.passed
    assert "P/D 4/10 (40%) < baseline 6/10 (60%) - tolerance 0.1; agreement 8/10" in two_less.verdict()
    doc = two_less.to_json()
    assert (doc["pd_accuracy"], doc["baseline_accuracy"], doc["agreement"]) == (0.4, 0.6, 0.8)
    assert doc["items"][0] == {"id": "i0", "kind": "fact", "expected": ["yes"], "pd_output": wrong,
                               "baseline_output": right, "pd_correct": False, "baseline_correct": True,
                               "agree": False, "same_output": False}
    better = score(s, [right] * 10, base, tolerance=0.0)  # P/D above the baseline passes
    assert better.passed and better.agreement == 0.6


def test_tolerance_out_of_range_is_bad_input():
    with pytest.raises(BadInput) as e:
        score(EVAL_SETS["basic"], [], [], tolerance=1.5)
    assert e.value.fields == ("eval_tolerance",)


def test_eval_file_and_bad_names(tmp_path: Path):
    f = tmp_path / "mine.json"
    f.write_text(json.dumps({"name": "mine", "max_tokens": 8,
                             "items": [{"id": "a", "kind": "number", "prompt": "1+1?", "answers": ["2"]}]}))
    mine = load_eval(str(f))
    assert (mine.name, mine.max_tokens, mine.prompts) == ("mine", 8, ["1+1?"])
    with pytest.raises(BadInput) as e:
        load_eval("no-such-set")
    assert e.value.fields == ("eval",) and "basic" in e.value.fix
    f.write_text(json.dumps({"items": [{"id": "a", "kind": "essay", "prompt": "p", "answers": ["x"]}]}))
    with pytest.raises(BadInput, match="kind must be one of"):
        load_eval(str(f))


def test_verify_eval_refuses_other_prompts_and_unknown_sets(kvctl: Kvctl):
    res = kvctl("verify", "--eval", "basic", "--prompt", "hi")
    assert res.rc == 2 and "--eval sends its own prompts" in res.stderr, res
    res = kvctl("verify", "--eval", "nope")
    assert res.rc == 2 and "no eval set 'nope'" in res.stderr and "--eval" in res.stderr, res


def test_scenario_eval_block(tmp_path: Path):
    base = {"name": "x", "prompts": ["hi"],
            "prefill": {"kv_transfer_config": {"kv_connector": "FSConnector", "kv_role": "kv_producer",
                                               "kv_connector_extra_config": {"fs_storage_path": "${store}"}}},
            "decode": {"kv_transfer_config": {"kv_connector": "FSConnector", "kv_role": "kv_consumer",
                                              "kv_connector_extra_config": {"fs_storage_path": "${store}"}}}}
    assert [p for p in check_scenario({**base, "eval": {"set": "basic"}}) if p.severity == "error"] == []
    s = Scenario.model_validate({**base, "eval": {"set": "basic"}})
    assert s.eval is not None and s.eval.tolerance == evals.DEFAULT_TOLERANCE and s.eval.max_tokens is None
    problems = check_scenario({**base, "eval": {"set": "basic", "tolrance": 0.2}})
    assert [p.path for p in problems if p.severity == "error"] == ["$.eval.tolrance"]
    assert "tolerance" in " ".join(p.fix for p in problems)
