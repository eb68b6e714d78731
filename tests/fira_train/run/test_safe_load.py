"""Resuming a checkpoint never runs code: DCP's ``.metadata`` through the restricted unpickler,
``state.pt`` through ``weights_only``, on ``--resume`` and through the Python API."""

from __future__ import annotations

import json
import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch

from fira_train.cli import main
from fira_train.files import file_digest
from fira_train.run import checkpoint as ckpt
from fira_train.run import dist_checkpoint
from fira_train.run.train import train
from tests.fira_train.harness_fixtures import micro_config
from tests.fira_train.tiny_lm import build_model, make_optimizer


class _System:
    """A pickle that runs ``touch SENTINEL`` through ``os.system`` when unpickled."""

    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self):
        return (os.system, (f"touch {self.sentinel}",))


def _unsafe() -> type:
    from fira_train.run.safe_load import UnsafeCheckpointError  # imported here: the old code lacks it

    return UnsafeCheckpointError


def _resume_cli(config) -> object:
    """``fira-train pretrain ... --resume``'s exit status (or what it raised)."""
    try:
        return main(["pretrain", *_cli_flags(config), "--resume"])
    except Exception as err:  # noqa: BLE001 -- the old code crashed here
        return err


def _cli_flags(config) -> list[str]:
    """``fira-train pretrain`` arguments for a micro_config (same data, out and options)."""
    return ["--recipe", "micro", "--method", config.optim.method, "--out", config.train.out_dir,
            "--steps", str(config.train.steps), "--save-every", str(config.train.save_every),
            "--data", config.data.source, f"data.cache_dir={config.data.cache_dir}", "data.vocab_size=300",
            "data.val_fraction=0.1", "train.progress=false", "train.tensorboard=false", "train.num_threads=1"]


def _dcp_save(directory: Path, method: str = "fira") -> Path:
    model = build_model()
    optimizer = make_optimizer(model, method)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return dist_checkpoint.save_checkpoint(directory, 1, model, optimizer, scheduler, {"step": 1})


@pytest.mark.parametrize("method", ["fira", "adamw"])
def test_real_dcp_metadata_reads_as_with_plain_pickle(tmp_path: Path, method: str) -> None:
    """The allow-list covers what torch 2.13's DCP writes (tensors, bytes, Fira's state, paths)."""
    from fira_train.run.safe_load import load_dcp_metadata

    path = _dcp_save(tmp_path, method)
    with open(path / ".metadata", "rb") as f:
        reference = pickle.load(f)  # our own file, written just now
    assert load_dcp_metadata(path / ".metadata") == reference


def _one_process_run(tmp_path: Path, *overrides: str):
    config = micro_config(tmp_path, "optim.method=adamw", "train.steps=2", "train.save_every=1",
                          "train.eval_every=0", *overrides)
    train(config)
    (tmp_path / "run" / "summary.json").unlink()  # stopped before its end: --resume loads a checkpoint
    return config, tmp_path / "run" / "checkpoints"


def test_malicious_dcp_metadata_is_refused_on_resume(tmp_path: Path, capsys) -> None:
    """The reviewer's attack: state.pt deleted, a DCP marker, a .metadata that calls os.system."""
    sentinel = tmp_path / "pwned"
    config, root = _one_process_run(tmp_path)
    step = root / "step_00000002"
    (step / "state.pt").unlink()
    (step / "COMPLETE").write_text(json.dumps({"format": dist_checkpoint.FORMAT, "step": 2}))
    (step / ".metadata").write_bytes(pickle.dumps(_System(sentinel)))

    code = _resume_cli(config)
    assert not sentinel.exists()
    assert code == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "refusing to load" in err and ".metadata" in err and "posix.system" in err
    assert not sentinel.exists()

    with pytest.raises(_unsafe(), match="posix.system"):  # the Python API
        train(config, resume="latest")
    with pytest.raises(_unsafe()):
        model = build_model()
        dist_checkpoint.load_checkpoint(step, model, make_optimizer(model, "adamw"))
    assert not sentinel.exists()
    # the older, intact checkpoint is not used to step past an unsafe one
    assert [s for s, _ in ckpt.complete_checkpoints(tmp_path / "run")] == [1, 2]

    with open(step / ".metadata", "rb") as f:  # the file really runs code under plain pickle
        pickle.load(f)
    assert sentinel.exists()


def test_malicious_state_pt_is_refused_on_resume(tmp_path: Path, capsys) -> None:
    sentinel = tmp_path / "pwned"
    config, root = _one_process_run(tmp_path)
    state_file = root / "step_00000002" / "state.pt"
    torch.save({"step": 2, "x": _System(sentinel)}, state_file)
    # a consistent marker: only weights_only stands between the file and the payload
    marker = {"step": 2, "size": state_file.stat().st_size, "sha256": file_digest(state_file)}
    (root / "step_00000002" / "COMPLETE").write_text(json.dumps(marker))

    code = _resume_cli(config)
    assert not sentinel.exists()
    assert code == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "refusing to load" in err and "state.pt" in err and "posix.system" in err
    with pytest.raises(_unsafe()):
        train(config, resume="latest")
    with pytest.raises(_unsafe()):
        ckpt.load_checkpoint(tmp_path / "run", state_file.parent)
    assert not sentinel.exists()
    torch.load(state_file, weights_only=False)  # the file really runs code under a plain load
    assert sentinel.exists()


@pytest.mark.parametrize("payload, refused", [
    (pickle.dumps(Path.touch), "pathlib.Path.touch"),       # a global outside the allow-list
    (pickle.dumps(getattr), "builtins.getattr"),
    # an allowed class called with arguments it is not given in DCP metadata (REDUCE of a dataclass)
    (b"\x80\x04\x8c%torch.distributed.checkpoint.metadata\x94\x8c\x08Metadata\x94\x93\x94}\x94\x85\x94R\x94.",
     "a call of Metadata"),
])
def test_metadata_unpickler_refuses_anything_else(tmp_path: Path, payload: bytes, refused: str) -> None:
    from fira_train.run.safe_load import load_dcp_metadata

    path = tmp_path / ".metadata"
    path.write_bytes(payload)
    with pytest.raises(_unsafe(), match=refused):
        load_dcp_metadata(path)


def test_damaged_metadata_is_a_checkpoint_error_not_a_crash(tmp_path: Path) -> None:
    from fira_train.run.safe_load import load_dcp_metadata

    path = _dcp_save(tmp_path)
    data = (path / ".metadata").read_bytes()
    (path / ".metadata").write_bytes(data[: len(data) // 2])
    with pytest.raises(ckpt.CheckpointError, match="truncated or damaged"):
        load_dcp_metadata(path / ".metadata")
    (path / ".metadata").write_bytes(pickle.dumps({"not": "metadata"}))
    with pytest.raises(ckpt.CheckpointError, match="not DCP Metadata"):
        load_dcp_metadata(path / ".metadata")


def test_metadata_sharing_one_object_among_many_keys_is_checked_once(tmp_path: Path, monkeypatch) -> None:
    """A pickle refers to one object as often as it likes (its memo): a list of many chunks, or a
    key path, shared by many keys made the check take their product (hours for a megabyte)."""
    from torch.distributed.checkpoint import metadata as md

    from fira_train.run import safe_load

    n = 400
    chunks = [md.ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([1]))] * n
    props = md.TensorProperties(dtype=torch.float32)
    shared = md.TensorStorageMetadata(properties=props, size=torch.Size([1]), chunks=chunks)
    items = {f"a{i}": shared for i in range(n)}  # one item under many keys
    items.update({f"b{i}": md.TensorStorageMetadata(properties=props, size=torch.Size([1]), chunks=chunks)
                  for i in range(n)})  # many items, one chunk list
    path = tmp_path / ".metadata"
    path.write_bytes(pickle.dumps(md.Metadata(state_dict_metadata=items, storage_data={})))
    calls = []
    real = safe_load._is_size
    monkeypatch.setattr(safe_load, "_is_size", lambda value: calls.append(1) or real(value))
    safe_load.load_dcp_metadata(path)
    assert len(calls) < 10 * n  # each key's size, each chunk's two: not keys times chunks

    class Counted(tuple):
        iterated = 0

        def __iter__(self):
            Counted.iterated += 1
            return super().__iter__()

    key_path = Counted(("app", "model", "w"))
    planner = md.Metadata(state_dict_metadata={}, storage_data={}, planner_data={f"k{i}": key_path for i in range(n)})
    safe_load._check_metadata(planner, str(path))
    assert Counted.iterated == 1


def test_a_planner_key_path_that_is_a_chunk_list_is_checked_as_a_key_path(tmp_path: Path) -> None:
    """The objects checked once (shared through the pickle's memo) were kept in one set for chunk
    lists and key paths alike: a key path that is the very list of a tensor's chunks passed
    unchecked, where a copy of it is refused."""
    from torch.distributed.checkpoint import metadata as md

    from fira_train.run import safe_load

    chunks = [md.ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([1]))]
    items = {"w": md.TensorStorageMetadata(properties=md.TensorProperties(dtype=torch.float32),
                                           size=torch.Size([1]), chunks=chunks)}
    path = tmp_path / ".metadata"
    for key_path in (list(chunks), chunks):
        path.write_bytes(pickle.dumps(md.Metadata(state_dict_metadata=items, storage_data={},
                                                  planner_data={"w": key_path})))
        with pytest.raises(ckpt.CheckpointError, match="planner_data is not a mapping of names to key paths"):
            safe_load.load_dcp_metadata(path)
