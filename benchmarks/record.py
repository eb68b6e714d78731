"""What every benchmark's JSON says about its run, and where it is written.

The scripts run as ``python benchmarks/<name>.py`` (this folder is then on ``sys.path``).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any


def provenance() -> dict[str, str]:
    """The command line, the UTC time and the machine's load average at the end of the run."""
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "not available"
    return {
        "command": "python " + shlex.join(sys.argv),  # quoted: arguments with spaces rerun as given
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "load": "1/5/15-min load average at the end: " + load,
    }


def machine(extra: str = "") -> str:
    """``"x86_64, 2 CPUs (<CPU model>), torch <version>"`` (plus ``extra``): what the timings ran on."""
    import platform

    import torch

    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            model = next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), "")
    except OSError:  # not Linux
        model = platform.processor()
    cpus = f"{os.cpu_count()} CPUs" + (f" ({model})" if model else "")
    return f"{platform.machine()}, {cpus}, torch {torch.__version__}" + (f", {extra}" if extra else "")


def save(result: dict[str, Any], out: str | None) -> None:
    """Write ``result`` as indented JSON to ``out`` (nothing if ``out`` is None)."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2))
