"""run_isolated: a function in a fresh process, its result or its exception back here."""

from __future__ import annotations

import os

import pytest

from fira_train.run.isolated import run_isolated


def test_the_function_runs_in_another_process_and_returns_its_result() -> None:
    assert run_isolated(os.getpid) != os.getpid()
    assert run_isolated(divmod, 17, 5) == (3, 2)


def test_its_exception_is_raised_here_with_its_type() -> None:
    with pytest.raises(FileExistsError, match="busy"):
        run_isolated(_refuse, "busy")


def _refuse(message: str) -> None:
    raise FileExistsError(message)
