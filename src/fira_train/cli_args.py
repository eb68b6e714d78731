"""``key=value`` overrides anywhere among the flags of a ``fira-train`` command.

``argparse`` fills a ``nargs="*"`` positional (the overrides) from one run of consecutive
positional strings, so ``pretrain --recipe micro train.steps=3 --method fira data.seq_len=16``
fails with "unrecognized arguments". :class:`IntermixedArgumentParser` parses the sub-commands'
arguments with ``parse_known_intermixed_args`` (flags first, then every remaining positional
string, in command-line order), so overrides may stand anywhere and keep their order: the later
of two overrides of one key wins. A parser with sub-commands of its own (``fira-train``,
``fira-train analyze``) parses as usual; ``argparse`` cannot intermix across sub-commands.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

__all__ = ["IntermixedArgumentParser", "StoreOnce"]


class IntermixedArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose positionals may be mixed with its flags (see the module)."""

    _intermixing = False

    def parse_known_args(self, args: Sequence[str] | None = None,
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        if self._intermixing or any(isinstance(a, argparse._SubParsersAction) for a in self._actions):
            return super().parse_known_args(args, namespace)
        self._intermixing = True  # parse_known_intermixed_args calls parse_known_args (Python < 3.13)
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False


class StoreOnce(argparse.Action):
    """``store``, refusing a second value: argparse keeps the last one silently, and reads an
    abbreviation as the whole flag, so ``compare --methods fira --method adamw`` trained adamw alone."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        earlier = getattr(namespace, self.dest, self.default)
        if earlier is not self.default:
            raise argparse.ArgumentError(self, f"given twice ({earlier!r}, then {option_string} {values!r}); "
                                               "give it once, with every value in one comma-separated list")
        setattr(namespace, self.dest, values)
