"""torch.distributed.checkpoint save / load: across world sizes, atomic under kill -9, safe."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from fira_train.run.dist_checkpoint import (
    MARKER,
    checkpoint_dir,
    is_complete,
    is_dcp_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    prune_checkpoints,
)
from tests.fira_train.tiny_lm import train_worker
from tests.multiprocess import run_ranks

STEPS, SAVE_AT = 5, 3  # the resumed run crosses the refresh at step 4 (T = 2)


def _assert_continues(straight: dict, resumed: dict) -> None:
    """The resumed run's losses from SAVE_AT on and its final parameters equal the run that
    never stopped (to fp64 round-off: the two runs split the batch differently)."""
    assert sorted(resumed["losses"]) == list(range(SAVE_AT, STEPS))
    for step, loss in resumed["losses"].items():
        assert loss == pytest.approx(straight["losses"][step], rel=1e-10), step
    for name, value in straight["params"].items():
        torch.testing.assert_close(resumed["params"][name], value, rtol=1e-9, atol=1e-11, msg=name)
    assert resumed["lr"] == pytest.approx(straight["lr"])  # the scheduler came back too
    for step, draw in resumed["draws"].items():  # and the torch, Python and NumPy RNG streams
        assert draw == straight["draws"][step], step


def _saved_keys(path: Path) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(str(path)).read_metadata().state_dict_metadata)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("save_mode, save_world, load_mode, load_world", [
    ("fsdp2", 2, "none", 1),
    ("none", 1, "fsdp2", 2),
    ("fsdp2", 2, "ddp", 2),
    ("fsdp2", 2, "fsdp2", 4),  # 9 rows over 4 ranks: 3, 3, 3 and an empty shard
])
def test_save_at_one_world_size_load_at_another_continues_identically(
    tmp_path, save_mode, save_world, load_mode, load_world
):
    """FSDP2 at world size 2 -> one process, one process -> FSDP2 at 2, FSDP2 -> DDP, FSDP2 at
    2 -> at 4: model, Fira state (sharded left bases and right moments, replicated ones),
    scheduler, data position and RNG come back and the run continues as if never stopped."""
    run_dir = str(tmp_path / "run")
    straight = run_ranks(train_worker, save_world, tmp_path / "a", save_mode, STEPS, "fira",
                         None, run_dir, SAVE_AT, timeout=50)
    path = checkpoint_dir(run_dir, SAVE_AT)
    assert is_complete(path) and latest_checkpoint(run_dir) == path and is_dcp_checkpoint(path)
    keys = _saved_keys(path)
    for rank in range(save_world):  # every rank's RNG, under the names the loader asks for
        assert {f"run.rng.rank{rank}.torch", f"run.rng.rank{rank}.python",
                f"run.rng.rank{rank}.numpy.0"} <= keys
    assert "app.optimizer.state.blocks.0.down.weight.basis" in keys  # Fira's state, by FQN
    recorded = json.loads((path / MARKER).read_text())["files"]  # every rank's shards, hashed
    assert sorted(recorded) == sorted(p.name for p in path.iterdir() if p.name != MARKER)
    assert {f"__{rank}_0.distcp" for rank in range(save_world)} <= set(recorded)
    resumed = run_ranks(train_worker, load_world, tmp_path / "b", load_mode, STEPS, "fira",
                        None, None, None, str(path), timeout=60)
    for rank, result in enumerate(resumed):
        # Each rank resumes its own RNG streams; ranks the checkpoint did not have take rank 0's.
        _assert_continues(straight[rank if rank < len(straight) else 0], result)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode, world", [("none", 1), ("fsdp2", 2)])
def test_a_parameter_without_state_when_saved_loads_without_one_and_the_run_continues(tmp_path, mode, world):
    """A layer with no gradient in any step before the save has no optimizer state in the
    checkpoint; torch's loader asked for one anyway (``Missing key ... step``), so the run could
    not resume. It now loads without one and trains on as the run that never stopped."""
    run_dir = str(tmp_path / "run")
    idle = SAVE_AT + 1  # first used after the save
    straight = run_ranks(train_worker, world, tmp_path / "a", mode, STEPS, "fira", None, run_dir, SAVE_AT,
                         None, idle, timeout=50)
    path = checkpoint_dir(run_dir, SAVE_AT)
    keys = _saved_keys(path)
    assert not any(key.startswith("app.optimizer.state.blocks.1.up.") for key in keys)
    assert "app.optimizer.state.blocks.0.up.weight.step" in keys
    resumed = run_ranks(train_worker, world, tmp_path / "b", mode, STEPS, "fira", None, None, None, str(path),
                        idle, timeout=60)
    for rank, result in enumerate(resumed):
        _assert_continues(straight[rank], result)


def test_a_saved_optimizer_state_is_never_left_out_of_a_load_without_a_word(tmp_path):
    """A parameter loads without a state only where the saved optimizer held it without one:
    one the saved optimizer did not hold, and a saved state the loading optimizer does not ask
    for (it has stepped: torch then asks only for the states it has), are refused by name."""
    import warnings

    from torch import nn

    from fira_optim import FiraAdamW
    from fira_train.run.dist_checkpoint import load_checkpoint, save_checkpoint

    def model():
        torch.manual_seed(0)
        return nn.ModuleDict({name: nn.Linear(8, 8, bias=False) for name in "ab"})

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    saved = model()
    over_a = FiraAdamW([{"params": [saved["a"].weight], "rank": 2}], lr=0.5)
    saved["a"].weight.grad = torch.randn(8, 8)
    over_a.step()
    path = save_checkpoint(tmp_path / "a", 1, saved, over_a)
    loading = model()
    both = FiraAdamW([{"params": [loading["a"].weight, loading["b"].weight], "rank": 2}], lr=1e-3)
    with pytest.raises(ValueError, match=r"the checkpoint's optimizer does not hold 'b.weight': it was saved by "
                                         r"an optimizer over other parameters"):
        load_checkpoint(path, loading, both)

    saved_both = FiraAdamW([{"params": [saved["a"].weight, saved["b"].weight], "rank": 2}])
    saved["b"].weight.grad = torch.randn(8, 8)
    saved_both.step()
    path = save_checkpoint(tmp_path / "both", 1, saved, saved_both)
    stepped = model()
    live = FiraAdamW([{"params": [stepped["a"].weight, stepped["b"].weight], "rank": 2}])
    stepped["a"].weight.grad = torch.randn(8, 8)
    live.step()  # a has a state, b none: torch's request leaves b's saved state out
    stepped["a"].weight.grad = None
    with pytest.raises(ValueError, match=r"the checkpoint holds an optimizer state for 'b.weight' that this "
                                         r"optimizer has no place for"):
        load_checkpoint(path, stepped, live)


def test_the_owner_of_a_nested_optimizer_state_is_its_parameter():
    """apollo keeps a projector dict in its state (``...down_proj.weight.projector.ortho``): the
    owner was read as ``down_proj.weight.projector``, and its resume refused."""
    from fira_train.run.dist_checkpoint import _saved_state_owners

    keys = {"app.optimizer.state.layers.0.down.weight.step", "app.optimizer.state.layers.0.down.weight.projector.ortho",
            "app.optimizer.state.layers.0.down.weight.projector.step", "app.optimizer.state.gone.weight.exp_avg",
            "app.optimizer.param_groups.0.lr", "app.model.layers.0.down.weight"}
    assert _saved_state_owners(keys, ["layers.0.down.weight", "layers.0.up.weight"]) == {"layers.0.down.weight",
                                                                                         "gone.weight"}


def _saved_at_step_2(run_dir: str) -> tuple:
    """A tiny model and its Fira optimizer after one step, saved as the checkpoint of step 2."""
    import fira_train.run.dist_checkpoint as ckpt
    from tests.fira_train.tiny_lm import build_model, make_optimizer

    model = build_model()
    optimizer = make_optimizer(model, "fira")
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    ckpt.save_checkpoint(run_dir, 2, model, optimizer, extra={"step": 2})
    return model, optimizer


def _kill_during_save_worker(rank: int, world: int, run_dir: str, where: str) -> None:
    """Save a checkpoint at step 2, then die (SIGKILL) in the middle of writing step 4."""
    import torch.distributed.checkpoint as dcp

    import fira_train.run.dist_checkpoint as ckpt

    model, optimizer = _saved_at_step_2(run_dir)

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    if where == "data":  # after DCP wrote the shards, before its metadata
        dcp.FileSystemWriter.finish = die
    else:  # everything written and synced, before the marker and the rename
        ckpt.write_synced = die
    optimizer.step()
    ckpt.save_checkpoint(run_dir, 4, model, optimizer, extra={"step": 4})


def _load_worker(rank: int, world: int, path: str) -> dict:
    from fira_train.run.dist_checkpoint import load_checkpoint
    from tests.fira_train.tiny_lm import build_model, make_optimizer

    model = build_model()
    optimizer = make_optimizer(model, "fira")
    return load_checkpoint(path, model, optimizer)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["data", "marker"])
def test_kill_during_write_leaves_previous_checkpoint_usable(tmp_path, where):
    run_dir = tmp_path / "run"
    with pytest.raises(AssertionError, match="exited with code -9"):
        run_ranks(_kill_during_save_worker, 1, tmp_path / "w", str(run_dir), where, timeout=40)
    partial = run_dir / ".tmp-step_00000004"
    assert partial.is_dir() and not is_complete(partial)
    assert not checkpoint_dir(run_dir, 4).exists()
    assert latest_checkpoint(run_dir) == checkpoint_dir(run_dir, 2)
    extra = run_ranks(_load_worker, 1, tmp_path / "l", str(checkpoint_dir(run_dir, 2)), timeout=40)[0]
    assert extra == {"step": 2}
    # The partial write is refused by name, a missing checkpoint is FileNotFoundError.
    with pytest.raises(AssertionError, match="incomplete"):
        run_ranks(_load_worker, 1, tmp_path / "l2", str(partial), timeout=40)
    with pytest.raises(AssertionError, match="FileNotFoundError"):
        run_ranks(_load_worker, 1, tmp_path / "l3", str(run_dir / "step_00000009"), timeout=40)


def _full_disk_worker(rank: int, world: int, run_dir: str, failing: int, where: str) -> dict:
    """Save step 2, then save step 4 with a full disk on rank ``failing``: its shards (``where``
    "shards") or, on rank 0, DCP's ``.metadata`` ("metadata"), the marker ("marker") or the
    checkpoint's folder ("folder"); or Ctrl-C as rank ``failing`` writes its shards ("interrupt").
    What each rank raised, and the command line's message for it."""
    import errno

    import torch.distributed.checkpoint as dcp

    import fira_train.run.dist_checkpoint as ckpt
    from fira_train.user_errors import describe

    model, optimizer = _saved_at_step_2(run_dir)

    def full(*args, **kwargs):
        if where == "interrupt":  # Ctrl-C as this rank writes its shards
            raise KeyboardInterrupt
        if where == "shards":  # some bytes land before the disk is full
            (Path(run_dir) / ".tmp-step_00000004" / f"__{rank}_0.distcp").write_bytes(b"part of a shard")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(Path(run_dir) / ".tmp-step_00000004" / "x"))

    if rank == failing and where == "marker":  # rank 0 alone writes it, the others wait
        ckpt.write_synced = full
    elif rank == failing and where == "folder":  # rank 0 alone makes it, the others wait
        make = Path.mkdir
        Path.mkdir = lambda path, *a, **k: full() if path.name == ".tmp-step_00000004" else make(path, *a, **k)
    elif rank == failing and where == "hash":  # reading back the files this rank hashes
        import fira_train.run.checkpoint_integrity as integrity

        integrity.file_record = lambda path: full()
    elif rank == failing:
        setattr(dcp.FileSystemWriter, "finish" if where == "metadata" else "write_data", full)
    optimizer.step()
    try:
        ckpt.save_checkpoint(run_dir, 4, model, optimizer, extra={"step": 4})
    except KeyboardInterrupt:  # the command line says "interrupted" for it
        return {"type": "KeyboardInterrupt"}
    except Exception as err:  # noqa: BLE001 -- reported to the test
        return {"type": type(err).__name__, "errno": getattr(err, "errno", None), "message": describe(err)}
    return {"type": None}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("failing, where, world", [
    (1, "shards", 2), (0, "metadata", 2), (0, "marker", 2), (0, "folder", 2), (1, "interrupt", 2), (0, "hash", 2),
    (1, "hash", 2), (0, "shards", 1), (0, "marker", 1)])
def test_a_full_disk_or_ctrl_c_during_a_save_is_the_same_error_on_every_rank(tmp_path, failing, where, world):
    """DCP wraps a rank's failure in a ``CheckpointException`` (a ``BaseException``) raised on
    every rank: a full disk while writing shards was a torch traceback on every rank instead of
    the command line's one-line message. Now every rank raises the failing rank's ``OSError``
    (no rank waits for another), and the previous checkpoint stays. A full disk as rank 0 alone
    made the folder or wrote the marker was raised by rank 0 alone, the others left in a barrier;
    a failure to read back the files a rank hashes for the marker, by that rank alone, the
    others left in the gather of the records. The failed save's temporary folder is removed (by
    rank 0, once every rank has given up on it), not left holding disk space until a resume."""
    run_dir = tmp_path / "run"
    results = run_ranks(_full_disk_worker, world, tmp_path / "w", str(run_dir), failing, where, timeout=50)
    for result in results:
        if where == "interrupt":  # Ctrl-C, not DCP's CheckpointException (a traceback)
            assert result["type"] == "KeyboardInterrupt", result
            continue
        assert result["type"] == "OSError" and result["errno"] == 28, result
        assert "no space left" in result["message"] and "the checkpoints already written stay" in result["message"], result
        assert "\n" not in result["message"]
    assert latest_checkpoint(run_dir) == checkpoint_dir(run_dir, 2)
    assert sorted(p.name for p in run_dir.iterdir()) == ["step_00000002"]  # no .tmp-step_00000004
    if where == "shards":
        assert run_ranks(_load_worker, world, tmp_path / "l", str(checkpoint_dir(run_dir, 2)), timeout=40) == \
            [{"step": 2}] * world


def _machine_disk_worker(rank: int, world: int, root: str) -> str:
    """Save a checkpoint into ``train.out_dir`` when each rank sees its own disk there: the
    same path on two machines without a shared file system (here one folder per rank)."""
    import fira_train.run.dist_checkpoint as ckpt
    from tests.fira_train.tiny_lm import build_model, make_optimizer

    model = build_model()
    optimizer = make_optimizer(model, "fira")
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    try:
        ckpt.save_checkpoint(Path(root) / f"machine{rank}" / "run", 2, model, optimizer, extra={"step": 2})
    except ValueError as err:
        return str(err)
    return ""


@pytest.mark.timeout(60)
def test_a_run_folder_that_the_machines_do_not_share_is_refused_at_the_first_checkpoint(tmp_path):
    """Two machines with ``--out`` on disks of their own: each rank's shards landed on its own
    machine, and rank 0 marked its folder complete without the others'. The run trained on,
    and every checkpoint was found damaged (files missing) only at ``--resume``. Now the first
    save stops every rank, naming the setting."""
    messages = run_ranks(_machine_disk_worker, 2, tmp_path / "w", str(tmp_path), timeout=50)
    for message in messages:
        assert "train.out_dir must be a folder that every machine" in message and "__1_0.distcp" in message
    assert latest_checkpoint(tmp_path / "machine0" / "run") is None


def _interrupted_load_worker(rank: int, world: int, path: str, kind: str) -> str:
    """Load ``path`` while DCP reads its tensors and ``kind`` ("interrupt", "memory") happens."""
    import torch.distributed.checkpoint as dcp

    def fail(*args, **kwargs):
        raise KeyboardInterrupt if kind == "interrupt" else MemoryError

    dcp.FileSystemReader.read_data = fail
    try:
        _load_worker(rank, world, path)
    except (KeyboardInterrupt, MemoryError) as err:
        return type(err).__name__
    except Exception as err:  # noqa: BLE001 -- reported to the test
        return f"{type(err).__name__}: {err}"
    return "loaded"


@pytest.mark.timeout(60)
def test_ctrl_c_or_no_memory_while_loading_is_not_called_a_damaged_checkpoint(tmp_path):
    """DCP wraps both in its CheckpointException, which the load turned into "could not be loaded
    (corrupt, unsafe or from a different model)": the run stopped as if the checkpoint were damaged."""
    path = _save_one_process(tmp_path / "run")
    assert run_ranks(_interrupted_load_worker, 1, tmp_path / "w", str(path), "interrupt", timeout=40) == [
        "KeyboardInterrupt"]
    assert run_ranks(_interrupted_load_worker, 1, tmp_path / "w2", str(path), "memory", timeout=40) == ["MemoryError"]


class _TwoPartError(Exception):
    """An error that pickles but does not unpickle: its __init__ takes two values and hands one
    message to Exception (pickle calls the class with that one)."""

    def __init__(self, what: str, why: str) -> None:
        super().__init__(f"{what}: {why}")


def _unpicklable_error_worker(rank: int, world: int, run_dir: str) -> str:
    """Rank 0's part of a save (the marker) raises an error that the other ranks cannot unpickle."""
    import fira_train.run.dist_checkpoint as ckpt
    from tests.fira_train.tiny_lm import build_model, make_optimizer

    def fail(*args, **kwargs):
        raise _TwoPartError("the marker", "could not be written")

    model = build_model()
    optimizer = make_optimizer(model, "fira")
    if rank == 0:
        ckpt.write_synced = fail
    try:
        ckpt.save_checkpoint(run_dir, 2, model, optimizer, extra={"step": 2})
    except Exception as err:  # noqa: BLE001 -- reported to the test
        return f"{type(err).__name__}: {err}"
    return "saved"


@pytest.mark.timeout(60)
def test_an_error_of_rank_0_that_does_not_unpickle_reaches_the_others_as_its_text(tmp_path):
    """Rank 0's error travels pickled; one that pickles but cannot be unpickled (a class whose
    __init__ takes other arguments than its message) made the receiving ranks raise a TypeError
    from inside broadcast_object_list (a traceback about __init__'s arguments) instead of it."""
    results = run_ranks(_unpicklable_error_worker, 2, tmp_path / "w", str(tmp_path / "run"), timeout=50)
    assert results == ["_TwoPartError: the marker: could not be written",
                       "RuntimeError: _TwoPartError: the marker: could not be written"], results


class _Exploit:
    """A pickle that creates a file when unpickled."""

    def __init__(self, sentinel: str):
        self.sentinel = sentinel

    def __reduce__(self):
        return (Path.touch, (Path(self.sentinel),))


def _crafted_checkpoint_worker(rank: int, world: int, path: str, sentinel: str) -> dict:
    """Write a complete checkpoint whose ``extra`` runs code when unpickled; load it with our
    loader, then with DCP's default planner (which does run it: the file is a real threat)."""
    import torch.distributed.checkpoint as dcp

    import fira_train.run.dist_checkpoint as ckpt
    from tests.fira_train.tiny_lm import build_model, make_optimizer

    model = build_model()
    optimizer = make_optimizer(model, "fira")
    state = ckpt._state(model, optimizer, None, None, save=True)
    state["run"].extra_json = _Exploit(sentinel)
    dcp.save(state, checkpoint_id=path)
    Path(path, ckpt.MARKER).write_text("{}")
    try:
        ckpt.load_checkpoint(path, model, optimizer)
        ours = "loaded"
    except Exception as err:
        ours = f"{type(err).__name__}: {err}"
    created_by_ours = Path(sentinel).exists()
    dcp.load({"run": {"extra_json": ""}}, checkpoint_id=path)  # DCP's default: weights_only=False
    return {"ours": ours, "created_by_ours": created_by_ours, "created_by_default": Path(sentinel).exists()}


@pytest.mark.timeout(60)
def test_crafted_pickle_in_checkpoint_is_refused(tmp_path):
    """Non-tensor values load with weights_only=True: a checkpoint carrying a pickle that
    would create a file is refused and the file is not created."""
    sentinel = tmp_path / "pwned"
    result = run_ranks(_crafted_checkpoint_worker, 1, tmp_path / "w", str(tmp_path / "ckpt"),
                       str(sentinel), timeout=40)[0]
    assert result["ours"].startswith("UnsafeCheckpointError: refusing to load") and "getattr" in result["ours"]
    assert not result["created_by_ours"]
    assert result["created_by_default"]  # the crafted file really runs code under a plain load


def test_listing_and_pruning_ignore_partial_and_keep_newest(tmp_path):
    for step in (1, 2, 3):
        path = checkpoint_dir(tmp_path, step)
        path.mkdir()
        (path / MARKER).write_text("{}")  # a single-file checkpoint's marker: not ours
    assert not is_dcp_checkpoint(checkpoint_dir(tmp_path, 1))
    checkpoint_dir(tmp_path, 4).mkdir()  # no marker: an interrupted write
    (tmp_path / ".tmp-step_00000005").mkdir()
    assert list_checkpoints(tmp_path) == [checkpoint_dir(tmp_path, s) for s in (1, 2, 3)]
    assert latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 3)
    assert prune_checkpoints(tmp_path, 1) == [checkpoint_dir(tmp_path, 1), checkpoint_dir(tmp_path, 2)]
    assert list_checkpoints(tmp_path) == [checkpoint_dir(tmp_path, 3)]
    with pytest.raises(ValueError, match="keep_last must be an integer >= 1, got 0"):
        prune_checkpoints(tmp_path, 0)
    with pytest.raises(ValueError, match="step must be an integer >= 0, got -1"):
        checkpoint_dir(tmp_path, -1)
    assert latest_checkpoint(tmp_path / "missing") is None


# ---------------------------------------------------------------------- integrity (sizes and hashes)


def _save_one_process(run_dir: Path, step: int = 1) -> Path:
    """A DCP checkpoint written by one process (no process group), as a one-process resume reads."""
    import warnings

    import fira_train.run.dist_checkpoint as dcp_ckpt
    from tests.fira_train.tiny_lm import build_model, make_optimizer

    model = build_model()
    optimizer = make_optimizer(model, "fira")
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return dcp_ckpt.save_checkpoint(run_dir, step, model, optimizer, extra={"step": step})


def _load_one_process(path: Path) -> dict:
    import warnings

    import fira_train.run.dist_checkpoint as dcp_ckpt
    from tests.fira_train.tiny_lm import build_model, make_optimizer

    model = build_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return dcp_ckpt.load_checkpoint(path, model, make_optimizer(model, "fira"))


def test_marker_records_size_and_hash_of_every_file(tmp_path):
    import hashlib
    import json

    path = _save_one_process(tmp_path)
    files = json.loads((path / MARKER).read_text())["files"]
    on_disk = sorted(p.name for p in path.iterdir() if p.name != MARKER)
    assert sorted(files) == on_disk and ".metadata" in files and "__0_0.distcp" in files
    for name, record in files.items():
        data = (path / name).read_bytes()
        assert record == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert _load_one_process(path) == {"step": 1}


def test_altered_shard_bytes_are_refused_naming_the_file(tmp_path):
    from fira_train.run.checkpoint import CheckpointError

    path = _save_one_process(tmp_path)
    shard = path / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit inside a tensor: DCP would load it silently
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp' is corrupted"):
        _load_one_process(path)
    shard.write_bytes(bytes(data[:-10]))
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp' is truncated"):
        _load_one_process(path)
    shard.unlink()
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp' is missing"):
        _load_one_process(path)


def test_zero_byte_metadata_is_a_clear_error_with_and_without_the_record(tmp_path):
    import json

    from fira_train.run.checkpoint import CheckpointError

    path = _save_one_process(tmp_path)
    (path / ".metadata").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"\.metadata' is truncated or altered: 0 bytes"):
        _load_one_process(path)
    marker = json.loads((path / MARKER).read_text())
    del marker["files"]  # as written before the record existed
    (path / MARKER).write_text(json.dumps(marker))
    with pytest.raises(CheckpointError, match=r"\.metadata' is empty"):
        _load_one_process(path)


def test_checkpoints_without_the_record_still_load(tmp_path):
    import json

    path = _save_one_process(tmp_path)
    marker = json.loads((path / MARKER).read_text())
    del marker["files"]
    (path / MARKER).write_text(json.dumps(marker))
    assert _load_one_process(path) == {"step": 1}


def test_an_int8_checkpoint_of_the_value_coding_loads_as_a_single_file_one_does(tmp_path):
    """Before square-root coding, an int8 second moment was stored as values under the scale
    name ``exp_avg_sq_scale``. A single-file checkpoint of that coding is converted on load; a
    DCP one was refused (DCP asked for ``exp_avg_sq_root_scale``: 'Missing key in checkpoint
    state_dict'). It now loads to the states the single-file load gives."""
    import copy
    import warnings

    import fira_optim
    import fira_train.run.dist_checkpoint as dcp_ckpt
    from fira_optim import precision

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128, bias=False))
        return model, fira_optim.FiraAdamW([{"params": list(model.parameters())}], lr=1e-2, state_dtype="int8")

    model, optimizer = build()
    weight = model[0].weight
    weight.grad = torch.randn(weight.shape, generator=torch.Generator().manual_seed(1))
    optimizer.step()
    entry = optimizer.state[weight]
    assert "exp_avg_sq_root_scale" in entry  # a quantized moment
    # the same state in the value coding of earlier versions
    value = precision._decode_moment("exp_avg_sq", entry["exp_avg_sq"], entry.pop("exp_avg_sq_root_scale"))
    codes, entry["exp_avg_sq_scale"] = precision._quantize(value, signed=False)
    entry["exp_avg_sq"] = codes.view(value.shape)
    saved = copy.deepcopy(optimizer.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = dcp_ckpt.save_checkpoint(tmp_path / "run", 1, model, optimizer, extra={"step": 1})

    single_model, single = build()
    single.load_state_dict(saved)  # the single-file checkpoint's load
    want = single.state[single_model[0].weight]
    assert "exp_avg_sq_root_scale" in want and "exp_avg_sq_scale" not in want

    loaded_model, loaded = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert dcp_ckpt.load_checkpoint(path, loaded_model, loaded) == {"step": 1}
    got = loaded.state[loaded_model[0].weight]
    assert sorted(got) == sorted(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key
    assert torch.equal(loaded_model[0].weight, weight)
