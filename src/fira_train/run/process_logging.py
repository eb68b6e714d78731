"""How a fira-train process logs: plain messages on stderr, and third-party notices printed at
import about parts no command uses kept out. Read by the command line before torch is loaded,
and by each worker process (:mod:`fira_train.run.isolated`), which configures its own."""

from __future__ import annotations

import logging
import sys

#: Loggers whose import-time warnings every run printed (transformers imports torchao for its
#: quantizers): torchao's CUDA-only kernel libraries that do not load on a CPU build and its
#: missing Triton, and torch's pytree deprecation notice about torchao's enums. Errors still show.
IMPORT_NOISE = ("torchao", "torch.utils._pytree")


def configure_logging(level: int) -> None:
    """Messages of ``level`` and above on stderr as bare lines; :data:`IMPORT_NOISE` at ERROR."""
    logging.basicConfig(level=level, format="%(message)s", stream=sys.stderr)
    for name in IMPORT_NOISE:
        logging.getLogger(name).setLevel(logging.ERROR)
