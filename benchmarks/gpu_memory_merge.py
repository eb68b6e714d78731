"""The tables that ``benchmarks/gpu_memory_rows.sh run`` brought back from a lent GPU, into the
committed ones (``docs/results/memory-measured/gpu-bf16``).

    python benchmarks/gpu_memory_merge.py FETCHED --code 56aa5f8 --when "2026-11-27, 19:54-20:01 UTC"
    python benchmarks/memory_summary.py docs/results/memory-measured/gpu-bf16

``FETCHED`` is the folder the device call's files came back to: ``FETCHED/<size>/memory.json``
(a copy of the committed table with the lanes' rows appended) and ``FETCHED/<size>.log`` for each
size. For each size this script

- rewrites the ``--out`` of the commands the lanes added (the device's folder) to the committed
  folder, so that every command in the table is one a user can run from the repository;
- puts a comment line before them: the lanes ran side by side on one GPU (its name from the
  first line of ``FETCHED/cuda-tests.log``), at code ``--code``, at ``--when``;
- gives each new row a ``code`` (``--code (--when)``), as the earlier rows have;
- decides whether the table is complete as ``--append`` does (every method that a command
  names has a row), also for lanes that ran older code;
- writes ``memory.json`` and ``memory.md`` into ``TO/<size>/`` and the size's log into
  ``TO/logs/<--log-prefix>-<size>.log`` (and ``cuda-tests.log`` beside them).

A table the lanes wrote on their own (``FETCHED/<size>-new``: --append refused the committed
one, measured on another machine or torch) is not merged: it is reported, to be committed as a
table of its own.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

from fira_train.files import write_text_atomic
from fira_train.measure import format_measurement, not_measured

TO = Path("docs/results/memory-measured/gpu-bf16")


def merge_size(fetched: Path, committed: Path, code: str, when: str, gpu: str = "GPU") -> list[str]:
    """Merge ``fetched/memory.json`` into ``committed``; the methods of the rows it adds."""
    record = json.loads((fetched / "memory.json").read_text())
    known = json.loads((committed / "memory.json").read_text()) if (committed / "memory.json").exists() else {}
    old_commands = set((known.get("command") or "").split("\n"))
    old_rows = {row["method"]: row for row in known.get("rows", [])}
    lines, header = [], f"# parallel lanes on one {gpu}, each its own process, code {code} ({when}), " \
                        f"benchmarks/gpu_memory_rows.sh:"
    for line in (record.get("command") or "").split("\n"):
        if line in old_commands or line.startswith("#"):
            lines.append(line)
            continue
        if header not in lines:
            lines.append(header)
        lines.append(re.sub(r"--out \S+", f"--out {committed.as_posix()}", line))
    added = []
    for row in record["rows"]:
        old = old_rows.get(row["method"])
        if old is None or _measured(row) != _measured(old):
            row["code"] = f"{code} ({when})"
            added.append(row["method"])
    record["command"] = "\n".join(lines) or None
    missing = not_measured(lines, (row["method"] for row in record["rows"]))
    if missing is not None:  # as --append decides today (the lanes may have run older code)
        record["complete"] = not missing
        record.pop("missing", None)
        record.update({"missing": missing} if missing else {})
    committed.mkdir(parents=True, exist_ok=True)
    write_text_atomic(committed / "memory.json", json.dumps(record, indent=1) + "\n")
    write_text_atomic(committed / "memory.md", format_measurement(record))
    return added


def _measured(row: dict) -> dict:
    """A row without what a merge or an --append adds to it (its code, its day)."""
    return {key: value for key, value in row.items() if key not in ("code", "date")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("fetched", type=Path, help="the folder the device call's files came back to")
    parser.add_argument("--code", required=True, help="the commit the lanes ran (short hash)")
    parser.add_argument("--when", required=True, help='the date and times of the lanes, e.g. "2026-11-27, 19:54-20:01 UTC"')
    parser.add_argument("--to", type=Path, default=TO, help=f"the committed tables (default {TO})")
    parser.add_argument("--log-prefix", default="lanes", help="the logs' names: PREFIX-<size>.log")
    args = parser.parse_args(argv)
    if not args.fetched.is_dir():
        parser.error(f"FETCHED must be a folder, got {str(args.fetched)!r}")
    tests_log = args.fetched / "cuda-tests.log"  # its first line: nvidia-smi's name and memory
    gpu = tests_log.read_text().split("\n")[0].split(",")[0].strip() if tests_log.exists() else ""
    sizes = sorted(p.parent.name for p in args.fetched.glob("*/memory.json"))
    if not sizes:
        parser.error(f"no <size>/memory.json under {str(args.fetched)!r}")
    for size in sizes:
        if size.endswith("-new"):
            print(f"{size}: a table of its own (--append refused the committed one); not merged")
            continue
        added = merge_size(args.fetched / size, args.to / size, args.code, args.when, gpu or "GPU")
        print(f"{size}: {len(added)} new or re-measured rows: {', '.join(added) or '-'}")
    (args.to / "logs").mkdir(parents=True, exist_ok=True)
    for log in sorted(args.fetched.glob("*.log")):
        shutil.copyfile(log, args.to / "logs" / f"{args.log_prefix}-{log.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
