r"""The options of an LLM-Adapters commonsense record, and the question posed as lm-eval poses it.

An LLM-Adapters record keeps its options inside the instruction text, e.g. (ARC, OpenBookQA and
SIQA alike; PIQA says ``Solution1:``, WinoGrande ``Option1:``, HellaSwag ``Ending1:``)::

    Please choose the correct answer to the question: Which factor ...?

    Answer1: a leg muscle ... Answer2: a bacterial population ... Answer3: ... Answer4: ...

    Answer format: answer1/answer2/answer3/answer4

:func:`parse_question` reads it from the end: the ``Answer format:`` line names the k labels,
then the markers ``Labelk:``, ..., ``Label1:`` are found right to left (case-insensitive, each the
last one before the next), so a marker-like word in the question does not split it; the stem is
the text before ``Label1:`` after the ``Please ...:`` preamble. BoolQ has no markers: its options
are ``true`` and ``false``.

:func:`multiple_choice` turns a record into (context, continuation) pairs, one per option, in
lm-eval's formulation of the same task (its ``arc_easy``, ``piqa``, ``social_iqa``,
``openbookqa``, ``boolq``, ``winogrande``, ``hellaswag`` configurations), scored by
:mod:`fira_train.finetune.loglik`:

===============  ========================================  ====================================
task             context                                   continuation of option i
===============  ========================================  ====================================
boolq            ``"Question: {question}\nAnswer:"``       ``" yes"`` (true), ``" no"`` (false)
piqa, ARC-*      ``"Question: {question}\nAnswer:"``       ``" {option_i}"``
social_i_qa      ``"Q: {question}\nA:"``                   ``" {option_i}"``
openbookqa       ``"{question}"``                          ``" {option_i}"``
hellaswag        ``"{activity}: {context}"`` (cleaned)     ``" {ending_i}"`` (cleaned)
winogrande       the sentence up to the blank + option i   ``" {the sentence after the blank}"``
===============  ========================================  ====================================

WinoGrande is lm-eval's partial scoring: the options differ in the context and every option is
scored on the same continuation. Differences from lm-eval that the data forces: BoolQ has no
passage (LLM-Adapters drops it), SIQA's context and question come joined, and HellaSwag's
``ctx_b`` is not re-capitalised (its text is cleaned as lm-eval cleans it: ``" [title]"`` becomes
``". "``, other bracketed tags go).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fira_train.finetune.commonsense import CommonsenseDataError, TaskSpec, resolve_task

__all__ = ["Question", "MultipleChoice", "parse_question", "multiple_choice"]


@dataclass(frozen=True)
class Question:
    """A record's question stem and its options, in the order of their labels."""

    stem: str
    options: tuple[str, ...]
    labels: tuple[str, ...]
    """``answer1``, ``answer2``, ... (``true``, ``false`` for boolq): the record's ``answer`` is one of them."""


@dataclass(frozen=True)
class MultipleChoice:
    """One question as lm-eval scores it: option i is the pair (context i, continuation i).

    Either one context is shared by every option and the continuations differ (most tasks), or
    the contexts differ and one continuation is shared (WinoGrande's partial scoring).
    """

    contexts: tuple[str, ...]
    continuations: tuple[str, ...]
    gold: int
    """Index of the correct option."""
    labels: tuple[str, ...]

    def __post_init__(self) -> None:
        n = len(self.labels)
        if n < 2 or {len(self.contexts), len(self.continuations)} != {1, n}:
            raise ValueError(f"{len(self.contexts)} contexts and {len(self.continuations)} continuations for "
                             f"{n} options: one of them must be shared (length 1), the other one per option")
        if not 0 <= self.gold < n:
            raise ValueError(f"gold={self.gold} must index one of the {n} options")

    @property
    def partial(self) -> bool:
        """Whether the options are in the contexts (one shared continuation)."""
        return len(self.contexts) > 1

    @property
    def requests(self) -> list[tuple[str, str]]:
        """The (context, continuation) pair of every option, in label order."""
        n = len(self.labels)
        contexts = self.contexts if self.partial else self.contexts * n
        continuations = self.continuations * n if self.partial else self.continuations
        return list(zip(contexts, continuations))


# (?<!\s): a search starts the whitespace before "Answer format:" at its first character only; from
# every character of a long run of spaces it took time quadratic in the run (a minute for 20,000)
_FORMAT = re.compile(r"(?<!\s)\s*Answer format:\s*(\S+)\s*$", re.IGNORECASE)
_PREAMBLE = re.compile(r"\s*Please [^:\n]*:\s*")


def _fail(spec: TaskSpec, instruction: str, why: str) -> CommonsenseDataError:
    return CommonsenseDataError(f"task {spec.name!r}: {why} in instruction={instruction!r:.300}")


def _last_marker(label: str, text: str, end: int) -> re.Match[str] | None:
    """The last ``Label:`` (e.g. ``Answer3:``) in ``text[:end]``, at the start or after whitespace."""
    found = None
    for match in re.compile(rf"(?:^|(?<=\s)){re.escape(label)}:", re.IGNORECASE).finditer(text, 0, end):
        found = match
    return found


def parse_question(task: str | TaskSpec, instruction: str) -> Question:
    """The stem and options of an LLM-Adapters ``instruction`` of ``task`` (see the module docstring).

    Raises :class:`~fira_train.finetune.commonsense.CommonsenseDataError` naming the task and
    quoting the instruction when the ``Answer format:`` line, a marker, the stem or an option is
    missing, or the labels of the format line are not the task's ``label1, ..., labelk``.
    """
    spec = task if isinstance(task, TaskSpec) else resolve_task(task)
    tail = _FORMAT.search(instruction)
    if tail is None:
        raise _fail(spec, instruction, "no 'Answer format: ...' line at the end")
    labels = tuple(tail.group(1).rstrip(".").lower().split("/"))
    if len(labels) < 2 or labels != spec.labels[: len(labels)]:
        raise _fail(spec, instruction, f"answer format {tail.group(1)!r} is not {'/'.join(spec.labels[:2])}/... "
                                       f"(the task's labels in order)")
    body = instruction[: tail.start()]
    if spec.name == "boolq":
        end, options = len(body), ("true", "false")
    else:
        starts: list[re.Match[str]] = []
        end = len(body)
        for label in reversed(labels):
            marker = _last_marker(label, body, end)
            if marker is None:
                raise _fail(spec, instruction, f"no option marker {label.capitalize()!r}:")
            starts.insert(0, marker)
            end = marker.start()
        ends = [m.start() for m in starts[1:]] + [len(body)]
        options = tuple(body[m.end() : e].strip() for m, e in zip(starts, ends))
        empty = [labels[i] for i, text in enumerate(options) if not text]
        if empty:
            raise _fail(spec, instruction, f"empty option {empty[0]}")
    preamble = _PREAMBLE.match(body, 0, end)
    stem = body[preamble.end() if preamble else 0 : end].strip()
    if not stem:
        raise _fail(spec, instruction, "no question text before the options")
    return Question(stem=stem, options=options, labels=labels)


#: Context templates of the tasks whose options are continuations (lm-eval's ``doc_to_text``).
_CONTEXT = {
    "boolq": "Question: {}\nAnswer:",
    "piqa": "Question: {}\nAnswer:",
    "ARC-Easy": "Question: {}\nAnswer:",
    "ARC-Challenge": "Question: {}\nAnswer:",
    "social_i_qa": "Q: {}\nA:",
    "openbookqa": "{}",
    "hellaswag": "{}",
}
#: BoolQ's options as lm-eval words them.
_BOOLQ_WORDS = {"true": "yes", "false": "no"}


def _clean_hellaswag(text: str) -> str:
    """lm-eval's HellaSwag clean-up: WikiHow's ``[title]`` marks become sentence ends, other tags go."""
    text = text.strip().replace(" [title]", ". ")
    # lm-eval's re.sub(r"\[.*?\]", "", text), line by line: after a line's last "]" no tag can
    # close, and a search from each "[" there scanned the rest of the line (quadratic: a line of
    # 40,000 "[" took half a minute)
    lines = []
    for line in text.split("\n"):
        head, close, tail = line.rpartition("]")
        lines.append(re.sub(r"\[.*?\]", "", head + close) + tail)
    text = "\n".join(lines)
    return text.replace("  ", " ")


def multiple_choice(task: str | TaskSpec, record: dict[str, str]) -> MultipleChoice:
    """``record`` (an LLM-Adapters record of ``task``) as lm-eval's (context, continuation) pairs.

    Raises :class:`~fira_train.finetune.commonsense.CommonsenseDataError` when the options cannot
    be read (:func:`parse_question`), the answer is not one of them, the record has an ``input``
    (the commonsense records have none; the option text could not say where it belongs), an
    option has no text (HellaSwag's, once cleaned), or a WinoGrande sentence has no blank ``_`` or
    nothing after it.
    """
    spec = task if isinstance(task, TaskSpec) else resolve_task(task)
    where = f" (record {record['index']})" if "index" in record else ""
    if record.get("input"):
        raise CommonsenseDataError(f"task {spec.name!r}{where} has input={record['input']!r:.100}: log-likelihood "
                                   f"scoring poses the instruction's question only; score with --scoring generate")
    try:
        question = parse_question(spec, record["instruction"])
    except CommonsenseDataError as err:
        raise CommonsenseDataError(f"{err}{where}") from None
    if record["answer"] not in question.labels:
        raise CommonsenseDataError(f"task {spec.name!r}{where}: answer={record['answer']!r} is not one of the "
                                   f"instruction's options {list(question.labels)}")
    gold = question.labels.index(record["answer"])
    stem, options = question.stem, question.options
    if spec.name == "winogrande":
        blank = stem.find("_")
        rest = stem[blank + 1 :].strip() if blank >= 0 else ""
        if not rest:
            raise CommonsenseDataError(f"task 'winogrande'{where}: the sentence {stem!r:.200} has "
                                       f"{'nothing after its blank _' if blank >= 0 else 'no blank _'} to score")
        return MultipleChoice(contexts=tuple(stem[:blank] + option for option in options),
                              continuations=(f" {rest}",), gold=gold, labels=question.labels)
    if spec.name == "boolq":
        stem = stem if stem.endswith("?") else stem + "?"
        options = tuple(_BOOLQ_WORDS[label] for label in question.labels)
    if spec.name == "hellaswag":
        stem, options = _clean_hellaswag(stem), tuple(_clean_hellaswag(o) for o in options)
    empty = [label for label, option in zip(question.labels, options) if not option.strip()]
    if empty:  # nothing to score (lm-eval fails on it, and its acc_norm would divide by 0)
        raise CommonsenseDataError(f"task {spec.name!r}{where}: option {empty[0]} has no text to score "
                                   f"(after cleaning)")
    return MultipleChoice(contexts=(_CONTEXT[spec.name].format(stem),),
                          continuations=tuple(f" {option}" for option in options), gold=gold, labels=question.labels)
