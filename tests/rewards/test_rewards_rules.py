"""Rule rewards on hand-made strings, and the registry's lookups and errors."""

from __future__ import annotations

import pytest

from raygraph.rewards import RewardRegistry, RewardResult, get, names, score_for_source
from raygraph.rewards.rules import last_boxed, normalize_math


def _acc_fmt(result: RewardResult) -> tuple[float, float, float]:
    return result.score, result.extras["acc"], result.extras["format_ok"]


@pytest.mark.parametrize("response, expected", [
    ("7", (1.0, 1.0, 1.0)),
    (" 7\n", (1.0, 1.0, 1.0)),
    ("8", (0.0, 0.0, 1.0)),
    ("77", (0.0, 0.0, 1.0)),      # the whole response must be the answer
    ("7+", (0.0, 0.0, 0.0)),
    ("", (0.0, 0.0, 0.0)),
])
def test_toy_arith(response, expected):
    assert _acc_fmt(score_for_source("toy_arith")(response, "7", None)) == expected


@pytest.mark.parametrize("response, expected", [
    ("1000 + 234 = 1234 so #### 1234", (1.0, 1.0, 1.0)),
    ("#### 1,234.", (1.0, 1.0, 1.0)),            # commas and a trailing period are fine
    ("#### $1234.00", (1.0, 1.0, 1.0)),          # a dollar sign and a numerically equal value
    ("#### 12 then #### 1234", (1.0, 1.0, 1.0)),  # the last marker wins
    ("#### 1235", (0.0, 0.0, 1.0)),
    ("the answer is 1234", (0.0, 0.0, 0.0)),     # strict: no '####', no reward
])
def test_gsm8k_strict(response, expected):
    assert _acc_fmt(score_for_source("openai/gsm8k")(response, "1234", None)) == expected
    assert score_for_source("gsm8k") is score_for_source("openai/gsm8k")


def test_gsm8k_flexible_falls_back_to_the_last_number():
    flexible = get("gsm8k_flexible")
    assert _acc_fmt(flexible("so 3 and then 1,234", "1234", None)) == (1.0, 1.0, 0.0)
    assert _acc_fmt(flexible("#### 5 but 1234", "1234", None)) == (0.0, 0.0, 1.0)
    assert flexible("no numbers", "1234", None).score == 0.0


def test_boxed_extraction_and_normalisation():
    assert last_boxed(r"first \boxed{1} then \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed 5$") == "5"
    assert last_boxed("no box") is None and last_boxed(r"\boxed{unclosed") is None
    assert normalize_math(r"\left( 1, 2 \right)") == "(1,2)"
    assert normalize_math(r"\dfrac{3}{4}.") == r"\frac{3}{4}"
    assert normalize_math(r"90^\circ") == "90" and normalize_math(r"\text{ 5 cm}") == "5cm"


@pytest.mark.parametrize("response, truth, expected", [
    (r"So $x = \boxed{\dfrac{1}{2}}$.", r"\frac{1}{2}", (1.0, 1.0, 1.0)),
    (r"\boxed{ 3.0 }", "3", (1.0, 1.0, 1.0)),
    (r"\boxed{4}", r"The answer is \boxed{4}", (1.0, 1.0, 1.0)),  # a boxed ground truth is unboxed
    (r"\boxed{5}", "4", (0.0, 0.0, 1.0)),
    ("4", "4", (0.0, 0.0, 0.0)),
])
def test_math_boxed(response, truth, expected):
    assert _acc_fmt(score_for_source("lighteval/MATH")(response, truth, None)) == expected


def test_registry_lookup_errors_list_the_valid_names():
    assert {"toy_arith", "gsm8k", "gsm8k_flexible", "math_boxed"} <= set(names())
    with pytest.raises(ValueError, match="known data sources: .*openai/gsm8k.*toy_arith"):
        score_for_source("no/such_source")
    with pytest.raises(ValueError, match="valid names: .*gsm8k_flexible"):
        get("gsm8k_lenient")


def test_a_fresh_registry_registers_and_rejects_duplicates():
    registry = RewardRegistry()

    @registry.register("always_one", sources=("mine",))
    def always_one(response_text, ground_truth, extra_info=None):
        return RewardResult(1.0, {"acc": 1.0})

    assert registry.names() == ("always_one",) and registry.sources() == ("mine",)
    assert registry.score_for_source("mine") is always_one and "always_one" in registry
    with pytest.raises(ValueError, match="already registered"):
        registry.register("always_one")(always_one)
    with pytest.raises(ValueError, match="already have a reward"):
        registry.register("other", sources=("mine",))(always_one)
    assert "always_one" not in names()  # the default registry is untouched
