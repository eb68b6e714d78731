"""Importing the released implementations we compare against (dev extra: fira==1.0.2,
galore-torch==1.0).

``fira`` imports ``transformers.utils.versions`` (transformers is in the dev extra). The
``galore_torch`` package imports its 8-bit optimizer, hence ``bitsandbytes``, at import time;
the ``GaLoreAdamW`` we compare against needs neither (see :func:`galore_adamw_class`). A missing
package is an error, not a skip: the parity tests are the point of the dev extra.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import sys

import fira  # noqa: F401  (fails loudly if the dev extra is missing)

_GALORE_ALIAS = "_galore_torch_without_init"


def galore_adamw_class():
    """``galore_torch.GaLoreAdamW`` (the ``galore_torch/adamw.py`` class), loaded without running
    the package ``__init__``, whose bitsandbytes import costs seconds and can fail on machines
    bitsandbytes does not support. The module is registered under a private package name, so a
    normal ``import galore_torch`` elsewhere is unaffected."""
    if _GALORE_ALIAS not in sys.modules:
        spec = importlib.util.find_spec("galore_torch")
        if spec is None or spec.origin is None:
            raise ImportError("galore-torch==1.0 is required for the parity tests (dev extra)")
        alias = importlib.util.spec_from_file_location(
            _GALORE_ALIAS, spec.origin,
            submodule_search_locations=list(spec.submodule_search_locations),
        )
        sys.modules[_GALORE_ALIAS] = importlib.util.module_from_spec(alias)  # not executed
    return importlib.import_module(f"{_GALORE_ALIAS}.adamw").AdamW


def quiet_fira_divide_params(*args, **kwargs):
    """``fira.divide_params`` prints one line per module; keep test output clean."""
    with contextlib.redirect_stdout(io.StringIO()):
        return fira.divide_params(*args, **kwargs)
