"""fira_train.finetune.stats and .paired: Wilson intervals, McNemar's exact test, pairing runs by example."""

from __future__ import annotations

import json
import math

import pytest

from fira_train.finetune.paired import Paired, compare, load_correctness, pool
from fira_train.finetune.stats import mcnemar_exact, wilson_interval


@pytest.mark.parametrize(
    "correct, n, expected",
    [
        # the closed form evaluated at 30 digits (mpmath); 0/10 has the textbook upper bound 0.2775
        (0, 10, (0.0, 0.27753280)),
        (10, 10, (0.72246720, 1.0)),
        (5, 10, (0.23659309, 0.76340691)),
        (81, 263, (0.25528852, 0.36620958)),
    ],
)
def test_wilson_known_values(correct, n, expected):
    low, high = wilson_interval(correct, n)
    assert low == pytest.approx(expected[0], abs=1e-7) and high == pytest.approx(expected[1], abs=1e-7)


def test_wilson_matches_the_closed_form_and_level():
    z = 2.5758293035489  # 99%
    k, n = 37, 120
    p = k / n
    center = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    assert wilson_interval(k, n, level=0.99) == pytest.approx((center - half, center + half), abs=1e-12)


@pytest.mark.parametrize("args, message", [((1, 0), "n=0 must be a positive integer"),
                                           ((11, 10), "correct=11 must be an integer in"),
                                           ((1, 10, 1.5), "level=1.5")])
def test_wilson_errors_name_the_argument(args, message):
    with pytest.raises(ValueError, match=message):
        wilson_interval(*args)


@pytest.mark.parametrize(
    "only_a, only_b, expected",
    [
        (0, 0, 1.0),
        (0, 5, 2 / 32),  # 2 * P(X <= 0), X ~ Bin(5, 1/2)
        (1, 6, 2 * (1 + 7) / 128),
        (3, 3, 1.0),
        (10, 2, 2 * (1 + 12 + 66) / 4096),
    ],
)
def test_mcnemar_exact_known_values(only_a, only_b, expected):
    assert mcnemar_exact(only_a, only_b) == pytest.approx(expected, rel=1e-12)
    assert mcnemar_exact(only_b, only_a) == pytest.approx(expected, rel=1e-12)  # symmetric


def test_mcnemar_is_exact_for_large_counts():
    # 2 * P(X <= 900), X ~ Bin(2000, 1/2): far in the tail but representable
    p = mcnemar_exact(900, 1100)
    assert 0 < p < 1e-5


def test_mcnemar_errors_name_the_argument():
    with pytest.raises(ValueError, match="only_b=-1 must be a non-negative integer"):
        mcnemar_exact(3, -1)


def test_against_scipy():
    stats = pytest.importorskip("scipy.stats")
    for k, n in [(0, 7), (3, 7), (250, 500), (499, 500), (1, 1)]:
        ci = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
        assert wilson_interval(k, n) == pytest.approx((ci.low, ci.high), abs=1e-12)
    for b, c in [(0, 1), (4, 9), (20, 20), (13, 31), (150, 190)]:
        assert mcnemar_exact(b, c) == pytest.approx(stats.binomtest(b, b + c, 0.5).pvalue, rel=1e-10)


def test_compare_counts_the_four_cells():
    a = {0: True, 1: True, 2: False, 3: False, 4: True}
    b = {0: True, 1: False, 2: True, 3: False, 4: False}
    paired = compare(a, b)
    assert paired == Paired(n=5, both=1, only_a=2, only_b=1, neither=1)
    assert paired.difference == pytest.approx(-0.2)
    assert paired.p_value == mcnemar_exact(2, 1)
    assert pool([paired, paired]) == Paired(n=10, both=2, only_a=4, only_b=2, neither=2)


def test_compare_refuses_different_examples():
    with pytest.raises(ValueError, match="fira and lora on boolq scored different examples .*--max-eval and --seed"):
        compare({0: True, 1: False}, {0: True, 2: False}, "fira and lora on boolq")


def test_load_correctness_reads_predictions_and_refuses_old_files(tmp_path):
    folder = tmp_path / "run" / "predictions"
    folder.mkdir(parents=True)
    rows = [{"index": 4, "correct": True, "prediction": "true"}, {"index": 9, "correct": False, "prediction": "x"}]
    (folder / "boolq.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert load_correctness(tmp_path / "run") == {"boolq": {4: True, 9: False}}
    with pytest.raises(FileNotFoundError, match="no predictions for piqa"):
        load_correctness(tmp_path / "run", ["boolq", "piqa"])
    (folder / "piqa.jsonl").write_text(json.dumps({"generation": "x", "prediction": "", "answer": "solution1"}) + "\n")
    with pytest.raises(ValueError, match="piqa.jsonl has lines without 'index' and 'correct'"):
        load_correctness(tmp_path / "run")
    # a line that is JSON but no record (AttributeError on row.get), an index that is no int
    for line in ("[1]", '{"index": "4", "correct": true}'):
        (folder / "piqa.jsonl").write_text(line + "\n")
        with pytest.raises(ValueError, match="piqa.jsonl has lines without 'index' and 'correct'"):
            load_correctness(tmp_path / "run")
