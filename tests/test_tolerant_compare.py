"""`--compare tolerant`: a divergence passes only at a near-tie of the baseline (pure units).

The same rule on real servers (a bf16 decode against an fp32 baseline, the
KV-noise plant, a decode that never received) is in tests/test_real_model_e2e.py.
"""

from __future__ import annotations

import pytest

from conftest import Kvctl
from kvctl.client import ChatResult, _top_logprobs
from kvctl.verify.checks import COMPARE_TOLERANT, check_output_matches_baseline, near_tie


def result(ids: list[int], tops: list[list[tuple[int, float]]] | None = None) -> ChatResult:
    strs = [f"t{i}" for i in ids]
    return ChatResult("".join(strs), ids, strs, 0.1, "r", None, "length", top_logprobs=tops)


BASE_TOPS = [[(1, -0.1), (9, -3.0)], [(2, -0.70), (7, -0.72)], [(3, -0.2), (8, -2.5)]]


def test_exact_stays_the_default_and_fails_any_divergence():
    base, dec = result([1, 2, 3], BASE_TOPS), result([1, 7, 5])
    check = check_output_matches_baseline(dec, base)
    assert not check.passed and "first differing token at position 1" in check.evidence


def test_a_near_tie_runner_up_passes_and_is_named():
    base, dec = result([1, 2, 3], BASE_TOPS), result([1, 7, 5])
    check = check_output_matches_baseline(dec, base, COMPARE_TOLERANT, 0.1)
    assert check.passed, check.evidence
    assert check.evidence.startswith("near-tie at position 1: decode 7 't7' vs baseline 2 't2', baseline gap "
                                     "0.0200 < epsilon 0.1, decode's token is the runner-up")
    tie = near_tie(dec, base, 1, 0.1)
    assert tie.explained and tie.to_json()["gap"] == pytest.approx(0.02)


@pytest.mark.parametrize("dec_ids,eps,why", [
    ([1, 2, 8], 0.1, "gap 2.3000 >= epsilon 0.1"),  # runner-up, but a wide gap
    ([1, 5, 3], 0.1, "is not the runner-up"),  # a near-tie, but not the runner-up
    ([1, 7, 3], 0.01, "gap 0.0200 >= epsilon 0.01"),  # a smaller epsilon
    ([1, 2], 0.1, "no top-2 logprobs"),  # shorter: a length change is never a tie
])
def test_anything_else_still_fails(dec_ids, eps, why):
    check = check_output_matches_baseline(result(dec_ids), result([1, 2, 3], BASE_TOPS), COMPARE_TOLERANT, eps)
    assert not check.passed and "not a near-tie" in check.evidence and why in check.evidence, check.evidence


def test_without_baseline_logprobs_a_divergence_fails():
    check = check_output_matches_baseline(result([1, 7, 5]), result([1, 2, 3]), COMPARE_TOLERANT)
    assert not check.passed and "no top-2 logprobs at position 1" in check.evidence


def test_top_logprobs_are_parsed_best_first():
    raw = {"content": [{"token": "token_id:5", "logprob": -0.1,
                        "top_logprobs": [{"token": "token_id:9", "logprob": -2.0},
                                         {"token": "token_id:5", "logprob": -0.1}]}]}
    assert _top_logprobs(raw) == [[(5, -0.1), (9, -2.0)]]
    assert _top_logprobs({"content": [{"token": "x", "top_logprobs": [{"token": "plain", "logprob": 0}]}]}) is None


def test_verify_refuses_an_unknown_compare_mode(kvctl: Kvctl):
    res = kvctl("verify", "--compare", "fuzzy")
    assert res.rc == 2 and "unknown --compare 'fuzzy'" in res.stderr, res


@pytest.mark.parametrize("name", ["fs-1p1d-gpu", "seed-replica-gpu", "v1-fs-1p1d-gpu", "v1-multi-1p1d-gpu"])
def test_nightly_gpu_scenarios_use_the_tolerant_mode_and_the_eval_gate(name):
    from kvctl.scenario.schema import load_scenario

    s = load_scenario(name)
    assert s.expectations.compare == COMPARE_TOLERANT
    assert s.eval is not None and s.eval.set == "basic"


def test_cpu_scenarios_stay_exact():
    from kvctl.scenario.schema import list_scenarios, load_scenario

    for path in list_scenarios():
        s = load_scenario(str(path))
        if not s.gpus:
            assert s.expectations.compare == "exact", path
