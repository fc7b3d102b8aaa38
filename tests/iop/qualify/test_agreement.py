"""The agreement part of a qualification (iop/qualify/agreement.py): word similarity, logprob
divergence over the tokens two runtimes share, the largest agreeing group and the flags of
those outside it."""

from __future__ import annotations

import pytest

from iop.qualify.agreement import THRESHOLD, Answer, compare, divergence, similarity

FIXED = {"count": "one, two, three, four, five, six, seven, eight, nine, ten",
         "capital": "The capital of France is Paris.",
         "arith": "391"}
OTHER = {"count": "uno dos tres cuatro cinco", "capital": "Lyon is a city.", "arith": "17"}


def answers(texts: dict[str, str]) -> dict[str, Answer]:
    return {i: Answer(t) for i, t in texts.items()}


def test_similarity_is_difflibs_ratio_over_words() -> None:
    assert similarity("the cat sat down", "the cat sat down") == 1.0
    assert similarity("a b c d", "a b c e") == pytest.approx(0.75)  # 2 * 3 matched / 8 words
    assert similarity("a b", "c d") == 0.0
    assert similarity("", "") == 1.0
    assert similarity("word", "") == 0.0
    # Whitespace is not a word: the same words spaced otherwise are the same answer.
    assert similarity("one  two\nthree", "one two three") == 1.0


def test_similarity_is_symmetric_on_reordered_words() -> None:
    a, b = "apple banana fig pear", "banana apple fig pear"
    assert similarity(a, b) == similarity(b, a) < 1.0


def test_divergence_is_the_mean_gap_over_the_common_prefix_of_the_same_tokens() -> None:
    a = [("Par", -0.1), ("is", -0.2), (".", -0.5)]
    b = [("Par", -0.3), ("is", -0.2), ("!", -0.1)]
    assert divergence(a, b) == pytest.approx(0.1)  # (0.2 + 0.0) / 2: stops at the first other token
    assert divergence(a, a) == 0.0
    assert divergence([("x", -1.0)], [("y", -1.0)]) is None  # no token in common
    assert divergence(a, None) is None
    assert divergence([], a) is None


def test_the_provider_serving_another_model_is_flagged_and_the_majority_passes() -> None:
    got = compare({"a": answers(FIXED), "b": answers(FIXED), "c": answers(OTHER)})
    assert got.group == ["a", "b"]
    assert got.flags == {"a": [], "b": [], "c": ["diverges"]}
    assert got.score["a"] == got.score["b"] == 1.0
    assert got.score["c"] is not None
    assert got.score["c"] < 0.3


def test_a_small_difference_still_agrees_and_the_score_says_how_much() -> None:
    near = {**FIXED, "capital": "The capital of France is Paris!"}  # one word of 6 differs
    got = compare({"a": answers(FIXED), "b": answers(FIXED), "c": answers(near)})
    assert got.group == ["a", "b", "c"]
    assert all(f == [] for f in got.flags.values())
    expected = (1 + 1 + similarity(FIXED["capital"], near["capital"])) / 3
    assert got.score["c"] == pytest.approx(expected, abs=1e-4)
    assert got.score["a"] == pytest.approx((1.0 + expected) / 2, abs=1e-4)
    assert THRESHOLD < got.score["c"] < 1.0


def test_the_largest_group_wins_even_when_a_smaller_one_agrees_more_closely() -> None:
    # x and y agree exactly; p, q, r agree with each other closely, and are three.
    base = "alpha beta gamma delta epsilon zeta eta theta iota kappa"
    close = "alpha beta gamma delta epsilon zeta eta theta iota lambda"
    got = compare({"p": answers({"1": base}), "q": answers({"1": base}), "r": answers({"1": close}),
                   "x": answers({"1": "one two"}), "y": answers({"1": "one two"})})
    assert got.group == ["p", "q", "r"]
    assert got.flags["x"] == got.flags["y"] == ["diverges"]
    assert got.flags["p"] == []


def test_two_providers_that_disagree_have_no_majority_and_both_are_flagged() -> None:
    got = compare({"a": answers(FIXED), "b": answers(OTHER)})
    assert got.flags == {"a": ["diverges", "no_majority"], "b": ["diverges", "no_majority"]}


def test_a_lone_provider_agrees_with_itself() -> None:
    got = compare({"a": answers(FIXED)})
    assert got.group == ["a"]
    assert got.score == {"a": 1.0}
    assert got.flags == {"a": []}


def test_a_provider_that_answered_nothing_is_flagged_alone_and_the_others_still_compare() -> None:
    got = compare({"a": answers(FIXED), "b": answers(FIXED), "c": answers(OTHER), "dead": {}})
    assert got.flags["dead"] == ["no_answers"]
    assert got.score["dead"] is None
    assert got.group == ["a", "b"]
    assert got.flags["a"] == got.flags["b"] == []
    assert got.flags["c"] == ["diverges"]


def test_providers_are_compared_over_the_prompts_both_answered() -> None:
    # b failed one prompt: it is judged on the two it answered, where it agrees.
    partial = {k: v for k, v in FIXED.items() if k != "arith"}
    got = compare({"a": answers(FIXED), "b": answers(partial), "c": answers(FIXED)})
    assert got.group == ["a", "b", "c"]
    assert got.score["b"] == 1.0


def test_logprob_divergence_is_measured_against_the_groups_reference() -> None:
    lp_a = [("Paris", -0.1), (".", -0.2)]
    lp_b = [("Paris", -0.4), (".", -0.2)]
    got = compare({"a": {"q": Answer("Paris.", lp_a)}, "b": {"q": Answer("Paris.", lp_b)},
                   "c": {"q": Answer("Paris.")}})
    assert got.group == ["a", "b", "c"]
    assert got.divergence["a"] == 0.0  # the reference itself
    assert got.divergence["b"] == pytest.approx(0.15)  # (0.3 + 0.0) / 2
    assert got.divergence["c"] is None  # its runtime gave no logprobs
