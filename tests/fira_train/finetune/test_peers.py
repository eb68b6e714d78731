"""fira-train finetune with the paper's other fine-tuning baselines: apollo, flora, slimadam."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from fira_train.finetune.config import DEFAULT_LR, DEFAULT_RANK, PEER_METHODS, FinetuneConfig  # noqa: E402
from fira_train.finetune.train import peer_optimizer  # noqa: E402
from tests.fira_train.finetune.test_run import run_cli, tiny_model_dir  # noqa: E402, F401 (fixture)


def test_peer_defaults() -> None:
    assert PEER_METHODS == ("apollo", "flora", "slimadam")
    assert DEFAULT_RANK["apollo"] == DEFAULT_RANK["flora"] == 32  # the paper's fine-tuning rank
    assert DEFAULT_LR["slimadam"] == DEFAULT_LR["apollo"] == DEFAULT_LR["adamw"]


def test_each_peer_fine_tunes_with_less_optimizer_state_than_adamw(tiny_model_dir, tmp_path) -> None:
    model_dir, data = tiny_model_dir
    common = ["--model", str(model_dir), "--tasks", "boolq", "--data-dir", str(data), "--max-eval", "2",
              "--max-new-tokens", "4", "--steps", "3", "--rank", "4", "--update-proj-gap", "2", "--scoring", "generate"]
    states, names = {}, {}
    for method in ("adamw", *PEER_METHODS):
        results = run_cli([*common, "--method", method, "--out", str(tmp_path / method)])
        training = results["training"]
        assert training["steps"] == 3 and results["config"]["method"] == method
        assert all(loss == loss for loss in training["loss_history"])  # finite (train_model checks too)
        states[method] = results["memory"]["optimizer_state_numel"]
        names[method] = training["optimizer"]
    assert names == {"adamw": "AdamW", "apollo": "APOLLOAdamW", "flora": "Flora", "slimadam": "SlimAdamW"}
    assert max(states[m] for m in PEER_METHODS) < states["adamw"]


def test_apollo_fine_tuning_projects_the_target_modules_at_scale_d_over_r(tiny_model_dir, tmp_path) -> None:
    import transformers

    model_dir, data = tiny_model_dir
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    config = FinetuneConfig(tasks=["boolq"], data_dir=str(data), method="apollo", rank=4,
                            target_modules="q_proj,v_proj", update_proj_gap=7, out=str(tmp_path / "o"))
    optimizer = peer_optimizer(model, config)
    regular, projected = optimizer.param_groups
    assert "rank" not in regular
    assert (projected["rank"], projected["scale"], projected["update_proj_gap"]) == (4, 48 / 4, 7)
    assert projected["scale_type"] == "channel" and len(projected["params"]) == 2 * 2  # q and v of 2 layers
