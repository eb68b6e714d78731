"""A run's logs: ``OUT/metrics.jsonl`` and TensorBoard (:class:`MetricsLog`), reading them back.

``OUT/metrics.jsonl`` holds one JSON object per optimizer step: ``step`` (optimizer steps
completed), ``loss`` (mean token loss of that step's batch), ``lr`` (the learning rate the step
used), ``tokens_per_s`` (that step's throughput) and ``tokens`` (training tokens so far); the
lines of evaluation steps add ``val_loss`` (mean over every validation token) and ``val_ppl``
(its exponential). A value that is not finite (a perplexity that overflows) is written as
``null`` (:mod:`fira_train.files`), never as ``Infinity`` / ``NaN``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from fira_train.files import cut_back_json_lines, dumps, open_append, read_json_lines


class MetricsLog:
    """Appends metric dicts to ``OUT/metrics.jsonl`` and, optionally, to TensorBoard ``OUT/tb``.

    On resume from step ``k`` the JSONL file is first cut back to the lines with ``step <= k``
    (a killed run may have logged steps past its last checkpoint, the last of them maybe cut
    short) and TensorBoard purges the same events, so the logs read like one uninterrupted run.
    """

    def __init__(self, out_dir: Path, *, tensorboard: bool, resume_step: int | None = None) -> None:
        self.path = Path(out_dir) / "metrics.jsonl"
        if resume_step is not None and self.path.exists():
            cut_back_json_lines(self.path, resume_step, hint=_DAMAGED_HINT)
        self._file = open_append(self.path)  # never through a link planted in its place, nor into a FIFO
        self._tb = None
        if tensorboard:
            # only with train.tensorboard: it takes half a second to import
            from torch.utils.tensorboard import SummaryWriter

            purge = resume_step + 1 if resume_step is not None else None
            self._tb = SummaryWriter(str(Path(out_dir) / "tb"), purge_step=purge)

    def log(self, record: dict[str, Any]) -> None:
        self._file.write(dumps(record) + "\n")  # NaN / inf as null
        self._file.flush()
        if self._tb is not None:
            step = record["step"]
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(out_dir: str | Path) -> list[dict[str, Any]]:
    """The records of ``OUT/metrics.jsonl`` (a non-finite value was written as ``None``)."""
    return read_json_lines(Path(out_dir) / "metrics.jsonl", hint=_DAMAGED_HINT)


_DAMAGED_HINT = ("repair or delete the damaged line (or the whole file: it only holds the logged metrics) "
                 "and run the command again")


def perplexity(mean_loss: float) -> float:
    """``exp(mean token loss)``; ``inf`` where that overflows."""
    try:
        return math.exp(mean_loss)
    except OverflowError:
        return float("inf")
