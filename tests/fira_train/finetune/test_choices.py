"""fira_train.finetune.choices: the options parsed from LLM-Adapters instructions, posed as lm-eval poses them."""

from __future__ import annotations

import pytest

from fira_train.finetune.choices import MultipleChoice, multiple_choice, parse_question
from fira_train.finetune.commonsense import CommonsenseDataError, default_data_dir, load_split

ARC = ("Please choose the correct answer to the question: Which factor will most likely cause a person to develop a "
       "fever?\n\nAnswer1: a leg muscle relaxing after exercise Answer2: a bacterial population in the bloodstream "
       "Answer3: several viral particles on the skin Answer4: carbohydrates being digested in the stomach\n\n"
       "Answer format: answer1/answer2/answer3/answer4")
PIQA = ("Please choose the correct solution to the question: How do I dry a wet phone?\n\nSolution1: Put it in "
        "rice.\n\nSolution2: Put it in water. \n\nAnswer format: solution1/solution2")
SIQA = ("Please choose the correct answer to the question: Tracy resisted Riley's attacks. What does Tracy need to "
        "do before this?\n\nAnswer1: make a new plan Answer2: Go home Answer3: Find somewhere to go\n\n"
        "Answer format: answer1/answer2/answer3")
WINO = ("Please choose the correct answer to fill in the blank to complete the given sentence: Sarah was a much "
        "better surgeon than Maria so _ always got the easier cases.\n\nOption1: Sarah Option2: Maria "
        "Answer format: option1/option2")
BOOLQ = ("Please answer the following question with true or false, question: do iran and afghanistan speak the "
         "same language?\n\nAnswer format: true/false")
OBQA = ("Please choose the correct answer to the question: The sun is responsible for\n\nAnswer1: puppies learning "
        "new tricks Answer2: children growing up Answer3: flowers wilting in a vase Answer4: plants sprouting\n\n"
        "Answer format: answer1/answer2/answer3/answer4")
HELLA = ("Please choose the correct ending to complete the given sentence: Playing drums: People are standing behind "
         "large drums. A man\n\nEnding1: is playing a bag pipe.\n\nEnding2: starts to play around the drums.\n\n"
         "Ending3: begins playing a drum set.\n\nEnding4: begins playing the drums [title] loudly.\n\n"
         "Answer format: ending1/ending2/ending3/ending4")


def record(instruction: str, answer: str, **extra) -> dict:
    return {"instruction": instruction, "input": "", "output": f"the correct answer is {answer}", "answer": answer,
            **extra}


@pytest.mark.parametrize(
    "task, instruction, stem, options",
    [
        ("ARC-Easy", ARC, "Which factor will most likely cause a person to develop a fever?",
         ("a leg muscle relaxing after exercise", "a bacterial population in the bloodstream",
          "several viral particles on the skin", "carbohydrates being digested in the stomach")),
        ("piqa", PIQA, "How do I dry a wet phone?", ("Put it in rice.", "Put it in water.")),
        ("social_i_qa", SIQA, "Tracy resisted Riley's attacks. What does Tracy need to do before this?",
         ("make a new plan", "Go home", "Find somewhere to go")),
        ("winogrande", WINO, "Sarah was a much better surgeon than Maria so _ always got the easier cases.",
         ("Sarah", "Maria")),
        ("boolq", BOOLQ, "do iran and afghanistan speak the same language?", ("true", "false")),
        ("openbookqa", OBQA, "The sun is responsible for",
         ("puppies learning new tricks", "children growing up", "flowers wilting in a vase", "plants sprouting")),
        ("hellaswag", HELLA, "Playing drums: People are standing behind large drums. A man",
         ("is playing a bag pipe.", "starts to play around the drums.", "begins playing a drum set.",
          "begins playing the drums [title] loudly.")),
    ],
)
def test_parse_question_inline(task, instruction, stem, options):
    question = parse_question(task, instruction)
    assert question.stem == stem and question.options == options
    assert len(question.labels) == len(options)


def test_a_marker_inside_the_question_does_not_split_it():
    instruction = ("Please choose the correct answer to the question: In the quiz, Answer1: was blank. Why?\n\n"
                   "Answer1: nobody knew Answer2: it was hidden\n\nAnswer format: answer1/answer2")
    question = parse_question("ARC-Challenge", instruction)
    assert question.stem == "In the quiz, Answer1: was blank. Why?"
    assert question.options == ("nobody knew", "it was hidden")


def test_five_options_and_lowercase_markers():
    instruction = ("Please choose the correct answer to the question: Pick one.\n\nanswer1: a answer2: b answer3: c "
                   "answer4: d answer5: e\n\nAnswer format: answer1/answer2/answer3/answer4/answer5")
    assert parse_question("ARC-Easy", instruction).options == ("a", "b", "c", "d", "e")


@pytest.mark.parametrize(
    "task, instruction, message",
    [
        ("ARC-Easy", "Please choose the correct answer to the question: Why?\n\nAnswer1: a Answer2: b",
         "no 'Answer format: ...' line"),
        ("ARC-Easy", ARC.replace("Answer3:", "Answer 3:"), "no option marker 'Answer3':"),
        ("piqa", ARC, "answer format 'answer1/answer2/answer3/answer4' is not solution1/solution2"),
        ("ARC-Easy", "Please choose the correct answer to the question: \n\nAnswer1: a Answer2: b\n\n"
                     "Answer format: answer1/answer2", "no question text"),
        ("ARC-Easy", "Please choose the correct answer to the question: Why?\n\nAnswer1: Answer2: b\n\n"
                     "Answer format: answer1/answer2", "empty option answer1"),
    ],
)
def test_parse_errors_name_the_task_and_quote_the_instruction(task, instruction, message):
    with pytest.raises(CommonsenseDataError, match=rf"task '{task}': .*{message}.*in instruction="):
        parse_question(task, instruction)


def test_contexts_and_continuations_are_lm_evals():
    arc = multiple_choice("ARC-Easy", record(ARC, "answer2"))
    assert arc.contexts == ("Question: Which factor will most likely cause a person to develop a fever?\nAnswer:",)
    assert arc.continuations[1] == " a bacterial population in the bloodstream" and arc.gold == 1
    assert arc.requests[3] == (arc.contexts[0], " carbohydrates being digested in the stomach")
    piqa = multiple_choice("piqa", record(PIQA, "solution1"))
    assert piqa.contexts == ("Question: How do I dry a wet phone?\nAnswer:",)
    siqa = multiple_choice("social_i_qa", record(SIQA, "answer3"))
    assert siqa.contexts[0].startswith("Q: Tracy") and siqa.contexts[0].endswith("\nA:") and siqa.gold == 2
    obqa = multiple_choice("openbookqa", record(OBQA, "answer4"))
    assert obqa.contexts == ("The sun is responsible for",) and obqa.continuations[3] == " plants sprouting"
    boolq = multiple_choice("boolq", record(BOOLQ, "false"))
    assert boolq.contexts == ("Question: do iran and afghanistan speak the same language?\nAnswer:",)
    assert boolq.continuations == (" yes", " no") and boolq.gold == 1
    hella = multiple_choice("hellaswag", record(HELLA, "ending4"))
    assert hella.continuations[3] == " begins playing the drums. loudly."  # lm-eval's clean-up of [title]


def test_winogrande_is_partial_scoring():
    wino = multiple_choice("winogrande", record(WINO, "option2"))
    assert wino.partial and wino.gold == 1
    assert wino.contexts == ("Sarah was a much better surgeon than Maria so Sarah",
                             "Sarah was a much better surgeon than Maria so Maria")
    assert wino.continuations == (" always got the easier cases.",)
    assert wino.requests == [(wino.contexts[0], wino.continuations[0]), (wino.contexts[1], wino.continuations[0])]
    with pytest.raises(CommonsenseDataError, match="no blank _"):
        multiple_choice("winogrande", record(WINO.replace(" _ ", " she "), "option1"))
    with pytest.raises(CommonsenseDataError, match="nothing after its blank"):
        multiple_choice("winogrande", record(WINO.replace(" _ always got the easier cases.", " _"), "option1"))


def test_record_errors_name_the_record():
    with pytest.raises(CommonsenseDataError, match=r"task 'ARC-Easy' \(record 7\): answer='answer5' is not one of"):
        multiple_choice("ARC-Easy", record(ARC, "answer5", index=7))
    with pytest.raises(CommonsenseDataError, match=r"\(record 3\).*has input='context'.*--scoring generate"):
        multiple_choice("ARC-Easy", {**record(ARC, "answer1", index=3), "input": "context"})
    with pytest.raises(CommonsenseDataError, match=r"no option marker.*\(record 2\)"):
        multiple_choice("ARC-Easy", record(ARC.replace("Answer2:", "Answer two:"), "answer1", index=2))
    # an ending that lm-eval's clean-up empties: nothing to score (lm-eval failed on it)
    with pytest.raises(CommonsenseDataError, match=r"task 'hellaswag' \(record 5\): option ending2 has no text"):
        multiple_choice("hellaswag", record(HELLA.replace("starts to play around the drums.", "[step]"), "ending1",
                                            index=5))


def test_crafted_text_is_read_in_linear_time():
    """A downloaded record's text: a long run of spaces before the format line, a long run of "["
    in a HellaSwag ending (quadratic in the regular expressions: 30,000 took half a minute each)."""
    import time

    spaces = HELLA.replace("A man\n", "A man" + " " * 30_000 + "x\n")
    brackets = HELLA.replace("a drum set.", "a drum set. " + "[" * 30_000)
    started = time.perf_counter()
    assert parse_question("hellaswag", spaces).stem.endswith("A man" + " " * 30_000 + "x")
    hella = multiple_choice("hellaswag", record(brackets, "ending3"))
    assert time.perf_counter() - started < 2.0
    assert hella.continuations[2] == " begins playing a drum set. " + "[" * 30_000  # no tag closes: kept
    # as lm-eval cleans: a tag closes at the first "]" on its line, across other "["
    assert multiple_choice("hellaswag", record(HELLA.replace("a drum set.", "a [x [y] drum] set."), "ending3")
                           ).continuations[2] == " begins playing a drum] set."


def test_multiple_choice_shape_is_checked():
    with pytest.raises(ValueError, match="one of them must be shared"):
        MultipleChoice(contexts=("a", "b"), continuations=(" x", " y"), gold=0, labels=("answer1", "answer2"))
    with pytest.raises(ValueError, match="gold=2"):
        MultipleChoice(contexts=("a",), continuations=(" x", " y"), gold=2, labels=("answer1", "answer2"))


REAL = default_data_dir()
#: The first test record of each task as the data holds it: (first words of the context, number of
#: options, gold index, the gold option's continuation).
FIRST = {
    "boolq": ("Question: does ethanol take more energy make that produces?\nAnswer:", 2, 1, " no"),
    "piqa": ("Question: How do I ready a guinea pig cage", 2, 0, " Provide the guinea pig with a cage full of a few "
             "inches of bedding made of ripped paper strips, you will also need to supply it with a water bottle and "
             "a food dish."),
    "social_i_qa": ("Q: Tracy didn't go home that evening", 3, 2, " Find somewhere to go"),
    "winogrande": ("Sarah was a much better surgeon than Maria so ", 2, 1, " always got the easier cases."),
    "ARC-Easy": ("Question: Which statement best explains why photosynthesis", 4, 0,
                 " Sunlight is the source of energy for nearly all ecosystems."),
    "ARC-Challenge": ("Question: An astronomer observes that a planet rotates faster", 4, 2,
                      " Planetary days will become shorter."),
    "openbookqa": ("A person wants to start saving money", 4, 1, " quit eating lunch out"),
}


@pytest.mark.skipif(not REAL.is_dir(), reason=f"commonsense data not at {REAL}")
@pytest.mark.parametrize("task", list(FIRST))
def test_real_first_examples(task):
    records = load_split(REAL, task, "test")
    start, n_options, gold, gold_text = FIRST[task]
    question = multiple_choice(task, records[0])
    assert len(question.labels) == n_options and question.gold == gold
    context, continuation = question.requests[gold]
    assert context.startswith(start) and continuation == gold_text
    # every test record of the task parses, with the gold answer among its options
    assert all(multiple_choice(task, r).gold >= 0 for r in records[:500])
