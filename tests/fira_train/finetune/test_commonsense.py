"""fira_train.finetune.commonsense: prompt format, answer extraction and scoring per task type, data loading."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fira_train.finetune.commonsense import (
    TASKS,
    CommonsenseDataError,
    default_data_dir,
    extract_answer,
    format_prompt,
    has_split,
    load_split,
    parse_tasks,
    resolve_task,
    score,
    subsample,
)


def test_prompt_without_input_is_the_alpaca_template_and_a_prefix_of_the_training_text():
    prompt = format_prompt("Say true or false.")
    assert prompt == (
        "Below is an instruction that describes a task. Write a response that appropriately completes the request."
        "\n\n### Instruction:\nSay true or false.\n\n### Response:\n"
    )
    full = format_prompt("Say true or false.", "", "the correct answer is true")
    assert full == prompt + "the correct answer is true"


def test_prompt_with_input_has_the_input_section():
    prompt = format_prompt("Choose.", "Some context.")
    assert "paired with an input" in prompt
    assert prompt.endswith("### Instruction:\nChoose.\n\n### Input:\nSome context.\n\n### Response:\n")


@pytest.mark.parametrize(
    "task, text, expected",
    [
        ("boolq", "the correct answer is false", "false"),
        ("boolq", "  true, not false", "true"),  # the first occurrence wins
        ("boolq", "The correct answer is True", "true"),  # case-insensitive (the release is not)
        ("boolq", "FALSE.", "false"),
        ("piqa", "Solution2", "solution2"),
        ("social_i_qa", "The correct answer is ANSWER3", "answer3"),
        ("winogrande", "Option1 fits", "option1"),
        ("hellaswag", "Ending2", "ending2"),
        ("boolq", "I do not know", ""),
        ("piqa", "the correct answer is solution2", "solution2"),
        ("piqa", "solution3 or solution1", "solution1"),
        ("social_i_qa", "the correct answer is answer3", "answer3"),
        ("siqa", "answer2.", "answer2"),  # alias
        ("winogrande", "the correct answer is option1", "option1"),
        ("winogrande", "answer1", ""),  # wrong label family
        ("ARC-Easy", "the correct answer is answer5", "answer5"),
        ("ARC-Challenge", "answer4answer1", "answer4"),
        ("openbookqa", "Answer: answer1", "answer1"),
        ("hellaswag", "the correct answer is ending4", "ending4"),
    ],
)
def test_extract_answer_per_task_type(task, text, expected):
    assert extract_answer(task, text) == expected


def test_score_counts_capitalised_answers_as_correct():
    # A model that answers "True" knew the answer: the released case-sensitive match scored it wrong.
    result = score("boolq", ["True", "The correct answer is False", "maybe"], ["true", "false", "true"])
    assert result == {"accuracy": 2 / 3, "correct": 2, "n": 3, "unparsed": 1}


def test_score_counts_correct_and_unparsed():
    result = score("piqa", ["the correct answer is solution1", "solution2", "no idea", "solution1"],
                   ["solution1", "solution1", "solution2", "solution1"])
    assert result == {"accuracy": 0.5, "correct": 2, "n": 4, "unparsed": 1}
    assert score("boolq", [], [])["accuracy"] == 0.0
    with pytest.raises(ValueError, match="differ in length"):
        score("boolq", ["true"], [])


def test_task_names_aliases_and_errors():
    assert [t.name for t in parse_tasks("boolq, siqa,ARC-e,arc-c,obqa,BoolQ")] == [
        "boolq", "social_i_qa", "ARC-Easy", "ARC-Challenge", "openbookqa"]
    assert resolve_task("WINOGRANDE").name == "winogrande"
    with pytest.raises(CommonsenseDataError, match="unknown task 'mmlu'"):
        resolve_task("mmlu")
    with pytest.raises(CommonsenseDataError, match="names no task"):
        parse_tasks(" , ")
    assert len(TASKS) == 8


def _write(root: Path, task: str, split: str, records) -> None:
    (root / task).mkdir(parents=True, exist_ok=True)
    (root / task / f"{split}.json").write_text(json.dumps(records))


def test_load_split_validates_records(tmp_path):
    good = {"instruction": "q?", "input": "", "output": "the correct answer is true", "answer": "true"}
    _write(tmp_path, "boolq", "test", [good, {**good, "input": None}])
    records = load_split(tmp_path, "boolq", "test")
    assert records[1]["input"] == "" and records[0] == good
    assert has_split(tmp_path, "boolq", "test") and not has_split(tmp_path, "boolq", "train")
    with pytest.raises(CommonsenseDataError, match=r"task 'boolq' has no train file: .*holds \['test'\]"):
        load_split(tmp_path, "boolq", "train")
    with pytest.raises(CommonsenseDataError, match="task 'piqa' has no test file"):
        load_split(tmp_path, "piqa", "test")
    parent = re.escape(str(tmp_path))
    with pytest.raises(CommonsenseDataError, match=rf"boolq itself holds test.json: data_dir is the folder that "
                                                   rf"holds one folder per task, here perhaps '{parent}'"):
        load_split(tmp_path / "boolq", "boolq", "test")  # the task's folder given for the data's
    _write(tmp_path, "piqa", "test", [{**good, "answer": "true"}])
    with pytest.raises(CommonsenseDataError, match="answer='true', not one of \\['solution1', 'solution2'\\]"):
        load_split(tmp_path, "piqa", "test")
    _write(tmp_path, "winogrande", "test", [{"instruction": "x"}])
    with pytest.raises(CommonsenseDataError, match="record 0 must be an object with string fields"):
        load_split(tmp_path, "winogrande", "test")
    _write(tmp_path, "openbookqa", "test", {"not": "a list"})
    with pytest.raises(CommonsenseDataError, match="must hold a JSON list"):
        load_split(tmp_path, "openbookqa", "test")
    (tmp_path / "ARC-Easy").mkdir()
    (tmp_path / "ARC-Easy" / "test.json").write_text("{broken")
    with pytest.raises(CommonsenseDataError, match="is not valid JSON"):
        load_split(tmp_path, "ARC-Easy", "test")
    (tmp_path / "ARC-Easy" / "test.json").write_text("\n".join(json.dumps(good) for _ in range(3)))  # JSON Lines
    with pytest.raises(CommonsenseDataError, match=r"Extra data: line 2 column 1 .*as JSON Lines does: the "
                                                   r"LLM-Adapters format is one JSON list of records"):
        load_split(tmp_path, "ARC-Easy", "test")
    (tmp_path / "ARC-Easy" / "test.json").write_text(" \n")  # a download that wrote nothing
    with pytest.raises(CommonsenseDataError, match=r"test.json is empty: it must hold a JSON list of records"):
        load_split(tmp_path, "ARC-Easy", "test")
    (tmp_path / "ARC-Easy" / "test.json").write_text("[" * 100_000)  # a RecursionError's traceback before
    with pytest.raises(CommonsenseDataError, match="is not valid JSON: nested too deeply"):
        load_split(tmp_path, "ARC-Easy", "test")
    with pytest.raises(CommonsenseDataError, match="data_dir='.*nowhere' is not a directory"):
        load_split(tmp_path / "nowhere", "boolq", "test")
    with pytest.raises(CommonsenseDataError, match="split='dev'"):
        load_split(tmp_path, "boolq", "dev")


def test_subsample_is_seeded_ordered_and_bounded():
    items = [{"i": i} for i in range(50)]
    a, b = subsample(items, 10, seed=1), subsample(items, 10, seed=1)
    assert a == b and len(a) == 10 and [x["i"] for x in a] == sorted(x["i"] for x in a)
    assert subsample(items, 10, seed=2) != a
    assert subsample(items, None) == items and subsample(items, 99) == items
    with pytest.raises(ValueError, match="limit=-1"):
        subsample(items, -1)


REAL = default_data_dir()


@pytest.mark.skipif(not REAL.is_dir(), reason=f"commonsense data not at {REAL}")
@pytest.mark.parametrize("task", ["boolq", "piqa", "social_i_qa", "winogrande", "ARC-Easy", "ARC-Challenge",
                                  "openbookqa"])
def test_real_test_sets_load_and_their_outputs_score_perfectly(task):
    records = load_split(REAL, task, "test")
    assert len(records) >= 500
    # The reference outputs ("the correct answer is X") extract to the gold answers: the protocol is consistent.
    result = score(task, [r["output"] for r in records], [r["answer"] for r in records])
    assert result["accuracy"] == 1.0 and result["unparsed"] == 0
