"""What every benchmark's JSON says about its run, and where it is written.

The scripts run as ``python benchmarks/<name>.py`` (this folder is then on ``sys.path``).
"""

from __future__ import annotations

import json
import os
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any


def provenance() -> dict[str, str]:
    """The command line, the UTC time and the machine's load average at the end of the run."""
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "not available"
    return {
        "command": "python " + " ".join(sys.argv),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "load": "1/5/15-min load average at the end: " + load,
    }


def save(result: dict[str, Any], out: str | None) -> None:
    """Write ``result`` as indented JSON to ``out`` (nothing if ``out`` is None)."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2))
