"""How a fira-train process logs: plain messages on stderr, and third-party notices printed at
import about parts no command uses kept out. Read by the command line before torch is loaded,
and by each worker process (:mod:`fira_train.run.isolated`), which configures its own."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

#: Loggers whose import-time warnings every run printed (transformers imports torchao for its
#: quantizers): torchao's CUDA-only kernel libraries that do not load on a CPU build and its
#: missing Triton, and torch's pytree deprecation notice about torchao's enums. Errors still show.
IMPORT_NOISE = ("torchao", "torch.utils._pytree")


def one_line_warnings(prefix: str) -> Callable[..., str]:
    """A ``warnings.formatwarning`` that writes ``"<prefix>: warning: <message> (<category>)"``: a
    library's warning (the optimizer's, torch's) in one line, as the command's own, not Python's
    two (the file of fira-train that raised it, and its source line)."""
    def format_warning(message: Warning | str, category: type[Warning], *_: Any, **__: Any) -> str:
        return f"{prefix}: warning: {message} ({category.__name__})\n"

    return format_warning


def configure_logging(level: int) -> None:
    """Messages of ``level`` and above on stderr as bare lines; :data:`IMPORT_NOISE` at ERROR."""
    logging.basicConfig(level=level, format="%(message)s", stream=sys.stderr)
    for name in IMPORT_NOISE:
        logging.getLogger(name).setLevel(logging.ERROR)
