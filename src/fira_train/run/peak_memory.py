"""Peak memory: of one run (:class:`PeakMemory`: CUDA's allocator on a GPU, the process's resident
set on the CPU), and the resident-set readings it is made of.

On Linux the resident-set peak (``VmHWM``) can be reset by writing ``5`` to
``/proc/self/clear_refs``, so phases executed one after another in one process (the runs of
``compare``, a fine-tuning's training) each get their own peak; where that is unavailable,
``ru_maxrss`` is the peak of the whole process so far.
"""

from __future__ import annotations

import os
import resource
import sys
from pathlib import Path

import torch


def reset_rss_peak() -> bool:
    """Reset the resident-set peak to the current resident set (Linux); whether that worked."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False  # not Linux / not permitted


def _status_bytes(field: str) -> int | None:
    """A ``kB`` line of ``/proc/self/status`` in bytes (Linux), or None."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def rss_peak_bytes() -> int | None:
    """Peak resident set since the last :func:`reset_rss_peak` (Linux ``VmHWM``), or None."""
    return _status_bytes("VmHWM")


def current_rss_bytes() -> int | None:
    """This process's resident set now (Linux ``VmRSS``), or None."""
    return _status_bytes("VmRSS")


def malloc_env() -> dict[str, str]:
    """glibc's ``MALLOC_*`` settings in this process's environment: they change how much freed
    memory stays resident, so a measured resident-set peak is only comparable with the same."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_")}


def env_prefix(env: dict[str, str]) -> str:
    """``env`` as a shell command's prefix (``"K=V K2=V2 "``; empty for none)."""
    return "".join(f"{k}={v} " for k, v in sorted(env.items()))


def process_peak_rss_bytes() -> int:
    """Peak resident set of the whole process so far (``ru_maxrss``)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return int(peak if sys.platform == "darwin" else peak * 1024)


class PeakMemory:
    """Peak memory of one run: CUDA ``max_memory_allocated`` on a GPU, else the process's peak
    resident set since :meth:`reset` (the whole process's where it cannot be reset)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.kind = "cuda_max_allocated" if device.type == "cuda" else "process_peak_rss"

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        reset_rss_peak()  # where it fails, peak_bytes falls back to the process-wide peak

    def peak_bytes(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        peak = rss_peak_bytes()
        return peak if peak is not None else process_peak_rss_bytes()
