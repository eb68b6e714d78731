"""parallelize(model, "ddp" | "fsdp2") on 2 gloo processes: the same training as one process."""

from __future__ import annotations

import pytest
import torch

from fira_train.run.parallel import DistributedEnv, parallelize, shard_batch, transformer_blocks
from tests.fira_train.tiny_lm import TinyLM, build_model, train_worker
from tests.multiprocess import run_ranks

STEPS = 5  # crosses the refreshes at steps 2 and 4 (T = 2)


def _one_process(kind: str = "fira") -> dict:
    """The same steps in this process, no process group: the reference."""
    return train_worker(0, 1, "none", STEPS, kind)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("split_refresh", [False, True])
def test_ddp_ranks_identical_and_equal_to_one_process(tmp_path, split_refresh):
    """DDP, each rank on half of the global batch: after two refreshes both ranks hold
    bitwise identical parameters, equal to a one-process run on the whole batch."""
    results = run_ranks(train_worker, 2, tmp_path, "ddp", STEPS, "fira",
                        {"split_refresh": split_refresh}, timeout=50)
    reference = _one_process()
    for name, value in reference["params"].items():
        assert torch.equal(results[0]["params"][name], results[1]["params"][name]), name
        torch.testing.assert_close(results[0]["params"][name], value, rtol=1e-9, atol=1e-11, msg=name)
    for step, loss in reference["losses"].items():
        assert results[0]["losses"][step] == pytest.approx(loss, rel=1e-10)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fira", "adamw"])
def test_fsdp2_training_equals_one_process(tmp_path, kind):
    """fully_shard on the tiny LM (rows 9 and 11 split 5/4 and 6/5): the gathered
    parameters and the losses equal the one-process run, Fira and plain AdamW alike."""
    results = run_ranks(train_worker, 2, tmp_path, "fsdp2", STEPS, kind, timeout=50)
    reference = _one_process(kind)
    for result in results:
        for name, value in reference["params"].items():
            torch.testing.assert_close(result["params"][name], value, rtol=1e-9, atol=1e-11, msg=name)
        for step, loss in reference["losses"].items():
            assert result["losses"][step] == pytest.approx(loss, rel=1e-10)


def _fsdp2_layout_worker(rank: int, world: int) -> dict:
    import fira_optim
    from fira_train.run.parallel import current_env

    model = parallelize(build_model(), "fsdp2", current_env())
    shapes = {name: (type(p).__name__, tuple(p.to_local().shape), str(p.placements))
              for name, p in model.named_parameters()}
    optimizer = fira_optim.FiraAdamW(fira_optim.param_groups(model, rank=2))
    projected = [tuple(p.shape) for p in optimizer.param_groups[1]["params"]]
    return {"shapes": shapes, "projected": projected, "fsdp_blocks": [
        type(m).__name__ for m in model.modules() if type(m).__name__.startswith("FSDP")]}


@pytest.mark.timeout(60)
def test_fsdp2_shards_every_block_on_dim0(tmp_path):
    results = run_ranks(_fsdp2_layout_worker, 2, tmp_path, timeout=50)
    shapes = [r["shapes"] for r in results]
    assert shapes[0]["blocks.0.up.weight"] == ("DTensor", (5, 6), "(Shard(dim=0),)")
    assert shapes[1]["blocks.0.up.weight"] == ("DTensor", (4, 6), "(Shard(dim=0),)")
    assert shapes[1]["head.weight"][1] == (5, 6)
    # param_groups sees the global 2-D shapes through the DTensors: the same choice as in one process
    assert results[0]["projected"] == [(9, 6), (6, 9), (9, 6), (6, 9), (11, 6)]
    # each block and the root are FSDP modules
    assert results[0]["fsdp_blocks"] == ["FSDPTinyLM", "FSDPBlock", "FSDPBlock"]


def test_parallelize_rejects_bad_input():
    model = TinyLM()
    with pytest.raises(ValueError, match="Invalid parallel mode: 'fsdp'"):
        parallelize(model, "fsdp")
    with pytest.raises(RuntimeError, match="needs a process group"):
        parallelize(model, "ddp", DistributedEnv())
    assert parallelize(model, "none") is model
    with pytest.raises(ValueError, match="global batch size 5 does not divide by the world size 2"):
        shard_batch(torch.zeros(5, 3), DistributedEnv(rank=1, world_size=2, backend="gloo"))
    batch = torch.arange(8).reshape(4, 2)
    assert torch.equal(shard_batch(batch, DistributedEnv(rank=1, world_size=2, backend="gloo")), batch[2:])


def test_transformer_blocks_finds_repeated_layers():
    model = TinyLM()
    assert transformer_blocks(model) == list(model.blocks)
    assert transformer_blocks(model, [torch.nn.Embedding]) == [model.embed]
    model._no_split_modules = ["Block"]  # what Hugging Face models declare
    assert transformer_blocks(model) == list(model.blocks)
