"""The run's JSON files: null, never Infinity / NaN, for non-finite values; a damaged file is
named (fira_train.files)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fira_train.files import DamagedFileError, dumps, read_json
from fira_train.run.metrics import MetricsLog, read_metrics


def test_json_files_write_null_for_non_finite_values(tmp_path: Path) -> None:
    text = dumps({"a": float("inf"), "b": [float("nan"), 1.5], "c": (float("-inf"),)})
    assert json.loads(text) == {"a": None, "b": [None, 1.5], "c": [None]}
    log = MetricsLog(tmp_path, tensorboard=False)
    log.log({"step": 1, "loss": 2.0, "val_ppl": float("inf")})
    log.close()
    assert "Infinity" not in (tmp_path / "metrics.jsonl").read_text()
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 2.0, "val_ppl": None}]
    (tmp_path / "bad.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(DamagedFileError, match=r"bad\.json is damaged \(not UTF-8"):
        read_json(tmp_path / "bad.json")
