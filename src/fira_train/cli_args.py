"""``key=value`` overrides anywhere among the flags of a ``fira-train`` command; each flag once.

``argparse`` fills a ``nargs="*"`` positional (the overrides) from one run of consecutive
positional strings, so ``pretrain --recipe micro train.steps=3 --method fira data.seq_len=16``
fails with "unrecognized arguments". :class:`IntermixedArgumentParser` parses the sub-commands'
arguments with ``parse_known_intermixed_args`` (flags first, then every remaining positional
string, in command-line order), so overrides may stand anywhere and keep their order (two
overrides of one key with different values are refused where the config is built:
:func:`fira_train.config.overrides.apply_command_line`). A parser with sub-commands of its own
(``fira-train``, ``fira-train analyze``) parses as usual; ``argparse`` cannot intermix across
sub-commands.

Every flag that takes a value and is stored (argparse's default action, ``store``) is
:class:`StoreOnce` in these parsers: given twice, it is an error naming the flag and both
values, where argparse keeps the last one silently (``--recipe 60m ... --recipe tiny``).
Flags that may repeat say so with their own action (``--lrs``: ``append``).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from typing import Any

__all__ = ["IntermixedArgumentParser", "StoreOnce"]


class IntermixedArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose positionals may be mixed with its flags, and whose stored
    flags take one value each (see the module)."""

    _intermixing = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # argument groups share these registries: every flag stored by default is StoreOnce
        self.register("action", None, StoreOnce)
        self.register("action", "store", StoreOnce)
        # a value that begins with a minus and a digit is a value, not a flag (no flag looks like
        # a number): argparse took "--lrs -0.001,0.001" and "--lrs -1e-3" for a flag missing its
        # value, and said only "expected one argument", not which value was refused
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def parse_known_args(self, args: Sequence[str] | None = None,
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        if self._intermixing:
            return super().parse_known_args(args, namespace)
        try:
            if any(isinstance(a, argparse._SubParsersAction) for a in self._actions):
                parsed = super().parse_known_args(args, namespace)
            else:
                self._intermixing = True  # parse_known_intermixed_args calls parse_known_args (Python < 3.13)
                parsed = self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False
            if namespace is not None:
                vars(namespace).pop(_GIVEN, None)
        vars(parsed[0]).pop(_GIVEN, None)  # the flags given: this parse's bookkeeping, not an argument
        return parsed


#: Where :class:`StoreOnce` keeps, in the namespace being parsed, the flags given so far and their
#: values (a default may equal a value given, so the namespace's values cannot tell).
_GIVEN = "_store_once_given"


class StoreOnce(argparse._StoreAction):
    """``store``, refusing a second value: argparse keeps the last one silently, and reads an
    abbreviation as the whole flag, so ``compare --methods fira --method adamw`` trained adamw alone.
    The same value twice is taken (a script that adds a flag the command already has changes
    nothing). A positional (no flag) is stored as by ``store``: argparse fills it once."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        if option_string is not None:
            given = vars(namespace).setdefault(_GIVEN, {})
            if self.dest in given and given[self.dest][1] != values:  # the same value again changes nothing
                earlier_flag, earlier = given[self.dest]
                listed = "comma-separated" in (self.help or "")
                also = ", with every value in one comma-separated list" if listed else ""
                raise argparse.ArgumentError(self, f"given twice ({earlier_flag} {earlier!r}, then {option_string} "
                                                   f"{values!r}); give it once{also}")
            given[self.dest] = (option_string, values)
        setattr(namespace, self.dest, values)
