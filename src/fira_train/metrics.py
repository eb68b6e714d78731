"""Run measurements and logs: metrics JSONL + TensorBoard, peak memory, optimizer-state size.

``OUT/metrics.jsonl`` holds one JSON object per optimizer step: ``step`` (optimizer steps
completed), ``loss`` (mean token loss of that step's batch), ``lr`` (the learning rate the step
used), ``tokens_per_s`` (that step's throughput) and ``tokens`` (training tokens so far); the
lines of evaluation steps add ``val_loss`` (mean over every validation token) and ``val_ppl``
(its exponential). A value that is not finite (a perplexity that overflows) is written as
``null`` (:mod:`fira_train.json_files`), never as ``Infinity`` / ``NaN``.
"""

from __future__ import annotations

import math
import os
import resource
import sys
from pathlib import Path
from typing import Any

import torch

import fira_optim
from fira_train.json_files import dumps, read_json_lines


def optimizer_state_numel(optimizer: torch.optim.Optimizer) -> int:
    """Elements held in the optimizer's state, step counters excluded.

    ``fira_optim.optimizer_state_numel`` counts every tensor in ``optimizer.state`` (any torch
    optimizer) except step counters.
    """
    return int(fira_optim.optimizer_state_numel(optimizer))


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held by the tensors of the optimizer's state (step counters excluded)."""
    total = 0
    for state in optimizer.state.values():
        for key, value in state.items():
            if key != "step" and torch.is_tensor(value):
                total += value.numel() * value.element_size()
    return total


class PeakMemory:
    """Peak memory of one run: CUDA ``max_memory_allocated`` on a GPU, else the process's peak RSS.

    On Linux the RSS peak (``VmHWM``) is reset at :meth:`reset` by writing ``5`` to
    ``/proc/self/clear_refs``, so runs executed one after another in one process (``compare``)
    each get their own peak; where that is unavailable it is ``ru_maxrss``, the peak of the
    whole process so far.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.kind = "cuda_max_allocated" if device.type == "cuda" else "process_peak_rss"

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass  # not Linux / not permitted: fall back to the process-wide peak

    def peak_bytes(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        try:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)


class MetricsLog:
    """Appends metric dicts to ``OUT/metrics.jsonl`` and, optionally, to TensorBoard ``OUT/tb``.

    On resume from step ``k`` the JSONL file is first cut back to the lines with ``step <= k``
    (a killed run may have logged steps past its last checkpoint) and TensorBoard purges the
    same events, so the logs read like one uninterrupted run.
    """

    def __init__(self, out_dir: Path, *, tensorboard: bool, resume_step: int | None = None) -> None:
        self.path = Path(out_dir) / "metrics.jsonl"
        if resume_step is not None and self.path.exists():
            kept = [record for record in read_json_lines(self.path, hint=_DAMAGED_HINT)
                    if record.get("step", 0) <= resume_step]
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(dumps(record) + "\n" for record in kept))
            os.replace(tmp, self.path)
        self._file = open(self.path, "a", encoding="utf-8")
        self._tb = None
        if tensorboard:
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
