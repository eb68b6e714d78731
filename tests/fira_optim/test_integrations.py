"""fira_optim.integrations: Fira inside transformers.Trainer, with peft, and through checkpoints."""

from __future__ import annotations

import copy
import math
import os
import subprocess
import sys
import warnings
from types import SimpleNamespace
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fira_optim import FiraAdamW, optimizer_state_numel, step_in_backward  # noqa: E402
from tests.multiprocess import run_ranks  # noqa: E402
from fira_optim.integrations import (  # noqa: E402
    FiraTrainer,
    _check_step_in_backward,
    create_fira_optimizer,
    create_fira_optimizer_and_scheduler,
    fira_optimizer_cls_and_kwargs,
    parse_optim_args,
    target_module_matches,
    target_parameter_names,
    trainer_param_groups,
)



HIDDEN, VOCAB, SEQ = 32, 64, 12


def tiny_llama(seed: int = 0, tie: bool = False) -> "transformers.LlamaForCausalLM":
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tie,
    )
    return transformers.LlamaForCausalLM(config)


class TokenDataset(torch.utils.data.Dataset):
    """Random token sequences with a learnable rule (next token = token + 1 mod VOCAB)."""

    def __init__(self, n: int = 32, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        self.ids = (start + torch.arange(SEQ)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def training_args(out: Path, **overrides) -> "transformers.TrainingArguments":
    options = dict(
        output_dir=str(out), per_device_train_batch_size=4, max_steps=6, learning_rate=1e-2,
        lr_scheduler_type="linear", warmup_steps=1, logging_steps=1, save_strategy="no", report_to="none",
        use_cpu=True, seed=0, data_seed=0, disable_tqdm=True, dataloader_num_workers=0,
        optim_target_modules=["q_proj", "v_proj", "mlp"], optim_args="rank=4,update_proj_gap=2,alpha=0.5",
    )
    options.update(overrides)
    return transformers.TrainingArguments(**options)


LINEARS_PER_LAYER = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ---------------------------------------------------------------- optim_args and target modules


def test_parse_optim_args_types_aliases_and_errors():
    parsed = parse_optim_args("rank=64, update_proj_gap=100,scale=0.25,proj_type=std,stagger=true,gamma=1.1")
    assert parsed == {"rank": 64, "update_proj_gap": 100, "alpha": 0.25, "proj_type": "std", "stagger": True,
                      "gamma": 1.1}
    assert isinstance(parsed["rank"], int) and isinstance(parsed["alpha"], float)
    assert parse_optim_args(None) == {} and parse_optim_args("") == {}
    with pytest.raises(ValueError, match=r"unknown key 'rnak' \(did you mean 'rank'\?\); FiraAdamW takes"):
        parse_optim_args("rnak=4")
    with pytest.raises(ValueError, match="rank='four' must be an integer"):
        parse_optim_args("rank=four")
    with pytest.raises(ValueError, match="must be key=value"):
        parse_optim_args("rank")
    with pytest.raises(ValueError, match="item 'rank 8' of 'alpha=1.0, rank 8' must be key=value"):
        parse_optim_args("alpha=1.0, rank 8")  # named as written, not with its spaces taken out
    with pytest.raises(ValueError, match="'lr' comes from the TrainingArguments"):
        parse_optim_args("lr=0.1")
    # options whose default is None (torch's choice) take the words true / false; a number stays one
    assert parse_optim_args("foreach=true,fused=False,seed=1") == {"foreach": True, "fused": False, "seed": 1}


def test_optim_args_given_twice_or_unparsable_are_refused_naming_where_they_came_from(tmp_path):
    """'rank=8,scale=0.5,alpha=0.25' trained at alpha=0.25 (the last one), without a word;
    'process_group=nccl' built the optimizer with the string as its group; a multi-line
    optim_args (a YAML block) read '\\nalpha' as an unknown key; and a bad fira_options value
    was reported as one of optim_args, which the user had not written."""
    with pytest.raises(ValueError, match=r"optim_args: 'alpha' is given twice \(as 'scale=0.5' and 'alpha=0.25'\)"):
        parse_optim_args("rank=8,scale=0.5,alpha=0.25")
    with pytest.raises(ValueError, match=r"optim_args: 'rank' is given twice \(as 'rank=8' and 'rank=16'\)"):
        parse_optim_args("rank=8,rank=16")
    with pytest.raises(ValueError, match=r"optim_args: 'alpha' is given twice"):
        parse_optim_args({"scale": 0.5, "alpha": 0.25})
    with pytest.raises(ValueError, match=r"optim_args: process_group='nccl' cannot be given as text"):
        parse_optim_args("rank=4,process_group=nccl")
    assert parse_optim_args("rank=8,\n\talpha=0.5\n") == {"rank": 8, "alpha": 0.5}
    # a variant is no FiraAdamW keyword: the error said 'unknown key', and listed keywords none of which is it
    with pytest.raises(ValueError, match=r"optim_args: variant='galore' is not a FiraAdamW keyword: give the "
                                         r"variant's options, 'residual=drop', or fira_options=\{'variant': 'galore'\}"):
        parse_optim_args("variant=galore,rank=8")
    model = tiny_llama()
    args = training_args(tmp_path)
    with pytest.raises(ValueError, match=r"^fira_options: unknown key 'rnak' \(did you mean 'rank'\?\)"):
        create_fira_optimizer(model, args, rnak=4)
    with pytest.raises(ValueError, match=r"^fira_options: rank='abc' must be an integer"):
        FiraTrainer(model=model, args=args, train_dataset=TokenDataset(),
                    fira_options={"rank": "abc"}).create_optimizer()
    with pytest.raises(ValueError, match=r"^optim_args: rank='x' must be an integer"):
        create_fira_optimizer(model, args, optim_args="rank=x")


@pytest.mark.parametrize(
    "targets, expected",
    [
        ("all-linear", {f"model.layers.{i}.{k}" for i in range(2) for k in
                        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")} | {"lm_head"}),
        ("all_linear", None),  # same as all-linear
        (["q_proj", "v_proj"], {f"model.layers.{i}.self_attn.{k}" for i in range(2) for k in ("q_proj", "v_proj")}),
        ([r"model\.layers\.1\.mlp\..*"], {f"model.layers.1.mlp.{k}" for k in ("gate_proj", "up_proj", "down_proj")}),
        (r"model\.layers\.0\.self_attn\.(q|k)_proj", {"model.layers.0.self_attn.q_proj",
                                                      "model.layers.0.self_attn.k_proj"}),
        # A string is a full-match regex: a bare substring matches nothing.
        ("q_proj", set()),
    ],
)
def test_target_parameter_names_follow_trainer_semantics(targets, expected):
    model = tiny_llama()
    if expected is None:
        expected = {n[: -len(".weight")] for n in target_parameter_names(model, "all-linear")}
    if not expected:
        with pytest.raises(ValueError, match="matches no trainable nn.Linear weight"):
            target_parameter_names(model, targets)
        return
    names = target_parameter_names(model, targets)
    assert {n[: -len(".weight")] for n in names} == expected
    # The same decision as transformers' own helper for every module.
    from transformers.trainer_utils import check_target_module_exists

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and not (isinstance(targets, str) and "all" in targets):
            assert target_module_matches(targets, name) == check_target_module_exists(targets, name)


def test_tied_output_head_is_not_projected_by_all_linear():
    model = tiny_llama(tie=True)
    names = target_parameter_names(model, "all-linear")
    assert "lm_head.weight" not in names and len(names) == 2 * len(LINEARS_PER_LAYER)


def test_target_module_type_errors():
    model = tiny_llama()
    with pytest.raises(ValueError, match="optim_target_modules is None"):
        target_parameter_names(model, None)
    with pytest.raises(TypeError, match="must be a list of strings"):
        target_parameter_names(model, 3)
    with pytest.raises(ValueError, match="not a valid regex"):
        target_parameter_names(model, "(")
    # a list entry is a regex too (tried on the names it is not a part of): named, as a string is
    with pytest.raises(ValueError, match=r"entry 'mlp\.\(up\|down_proj' is not a valid regex"):
        target_parameter_names(model, ["q_proj", "mlp.(up|down_proj"])


def test_target_entries_that_select_nothing_are_named():
    """['q_proj', 'v_prj'] projected the q projections only, without a word (the typo selected
    nothing); a string 'q_proj' (the CLI's --optim_target_modules q_proj) and GPT-2's Conv1D
    layers were refused with a list of linear modules that did not say why they missed."""
    model = tiny_llama()
    with pytest.warns(UserWarning, match=r"optim_target_modules=\['q_proj', 'v_prj', 'embed_tokens'\]: the entries "
                                         r"\['v_prj', 'embed_tokens'\] select no trainable nn.Linear weight"):
        names = target_parameter_names(model, ["q_proj", "v_prj", "embed_tokens"])
    assert len(names) == 2
    with pytest.warns(UserWarning, match=r"not nn.Linear, left out as by the Trainer's GaLore: "
                                         r"\['model.embed_tokens \(Embedding\)'\]"):
        target_parameter_names(model, ["q_proj", "embed_tokens"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every entry selects a weight: nothing to say
        target_parameter_names(model, ["q_proj", "mlp", r"model\.layers\.0\.self_attn\.k_proj"])
    with pytest.raises(ValueError, match=r"a string is a regular expression that must match the whole module name: "
                                         r"for the modules whose name contains 'q_proj' give a list, \['q_proj'\]"):
        target_parameter_names(model, "q_proj")
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=VOCAB,
                                                                n_positions=SEQ))
    with pytest.raises(ValueError, match=r"matches modules that are not nn.Linear, left out as by the Trainer's "
                                         r"GaLore: \['transformer.h.0.attn.c_attn \(Conv1D\)'\]"):
        target_parameter_names(gpt2, ["c_attn"])


def test_trainer_param_groups_cover_every_trainable_parameter_once():
    model = tiny_llama()
    model.model.norm.weight.requires_grad_(False)
    groups = trainer_param_groups(model, ["q_proj"], weight_decay=0.1, rank=4)
    ids = [id(p) for g in groups for p in g["params"]]
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(ids) == len(set(ids)) == len(trainable)
    projected, decayed, plain = groups
    assert projected["rank"] == 4 and len(projected["params"]) == 2
    assert decayed["rank"] is None and decayed["weight_decay"] == 0.1
    assert all(p.ndim >= 2 for p in decayed["params"])
    assert plain["weight_decay"] == 0.0 and all(p.ndim == 1 for p in plain["params"])


def test_a_projected_weight_left_out_of_the_decay_list_is_projected_without_decay():
    """The Trainer's decay list decides for the projected weights too (a subclass's
    get_decay_parameter_names may leave some out); the groups of a list that leaves none out
    are unchanged (their indices are in every checkpoint)."""
    model = tiny_llama()
    names = [n for n, _ in model.named_parameters()]
    kept = "model.layers.0.self_attn.q_proj.weight"
    decay = [n for n in names if n != kept and not n.endswith("norm.weight")]
    groups = trainer_param_groups(model, ["q_proj"], weight_decay=0.1, decay_parameter_names=decay, rank=4)
    assert [(g["rank"], g["weight_decay"], len(g["params"])) for g in groups] == [
        (4, 0.1, 1), (None, 0.1, len(decay) - 1), (None, 0.0, len(names) - len(decay) - 1), (4, 0.0, 1)]
    assert groups[-1]["params"][0] is model.get_parameter(kept)
    optimizer = create_fira_optimizer(model, SimpleNamespace(weight_decay=0.1, optim_target_modules=["q_proj"],
                                                             optim_args="rank=4", learning_rate=1e-3,
                                                             adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8),
                                      decay_parameter_names=decay)
    by_param = {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
    assert by_param[id(model.get_parameter(kept))] == 0.0
    assert by_param[id(model.get_parameter("model.layers.1.self_attn.q_proj.weight"))] == 0.1


def test_create_fira_optimizer_reads_training_arguments_and_keywords_win(tmp_path):
    model = tiny_llama()
    args = training_args(tmp_path, adam_beta1=0.8, adam_epsilon=1e-7, weight_decay=0.01)
    optimizer = create_fira_optimizer(model, args, gamma=1.05)
    assert isinstance(optimizer, FiraAdamW)
    projected = [g for g in optimizer.param_groups if g["rank"] is not None]
    assert len(projected) == 1 and projected[0]["rank"] == 4
    g = projected[0]
    assert (g["update_proj_gap"], g["alpha"], g["gamma"], g["lr"]) == (2, 0.5, 1.05, 1e-2)
    assert g["betas"] == (0.8, 0.999) and g["eps"] == 1e-7 and g["weight_decay"] == 0.01
    # 2 layers x (q, v, gate, up, down): "mlp" is a substring of the MLP linears' names.
    assert len(g["params"]) == 10
    galore = create_fira_optimizer(model, args, variant="galore", optim_args="rank=2")
    assert [g["residual"] for g in galore.param_groups if g["rank"] is not None] == ["drop"]
    with pytest.raises(ValueError, match="variant='fira-typo'"):
        create_fira_optimizer(model, args, variant="fira-typo")
    # the run's seed draws the random projectors and stochastic rounding; optim_args or a keyword win
    assert {g["seed"] for g in create_fira_optimizer(model, training_args(tmp_path, seed=5)).param_groups} == {5}
    assert {g["seed"] for g in create_fira_optimizer(model, training_args(tmp_path, seed=5),
                                                     optim_args="rank=4,seed=9").param_groups} == {9}
    assert {g["seed"] for g in create_fira_optimizer(model, training_args(tmp_path, seed=5), seed=3).param_groups} == {3}


def test_importing_fira_optim_does_not_import_transformers():
    code = "import sys, fira_optim; assert 'transformers' not in sys.modules, 'transformers imported'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# ---------------------------------------------------------------- training through the Trainer


def _fira(trainer) -> FiraAdamW:
    """The Trainer's optimizer with accelerate's wrapper removed."""
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    assert isinstance(optimizer, FiraAdamW)
    return optimizer


def _final_losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj"], r".*\.mlp\.(up|down)_proj"])
def test_fira_trainer_trains_with_each_target_form(tmp_path, targets):
    model = tiny_llama()
    args = training_args(tmp_path, optim_target_modules=targets, max_steps=5)
    trainer = FiraTrainer(model=model, args=args, train_dataset=TokenDataset())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()
    _fira(trainer)
    losses = _final_losses(trainer)
    assert len(losses) == 5 and all(math.isfinite(x) for x in losses)
    projected = set(target_parameter_names(model, targets))
    assert projected and all(not torch.equal(before[n], p) for n, p in model.named_parameters() if n in projected)
    # The projected matrices really keep a rank-4 state (basis and low-rank moments).
    state = _fira(trainer).state[dict(model.named_parameters())[sorted(projected)[0]]]
    assert 4 in state["basis"].shape and 4 in state["exp_avg"].shape


def test_optimizers_pair_and_cls_and_kwargs_give_the_same_training(tmp_path):
    args = training_args(tmp_path, max_steps=4)
    results = []
    for mode in ("pair", "factory", "subclass"):
        model = tiny_llama()
        if mode == "pair":
            pair = create_fira_optimizer_and_scheduler(model, args, num_training_steps=4)
            trainer = transformers.Trainer(model=model, args=args, train_dataset=TokenDataset(), optimizers=pair)
        elif mode == "factory":
            trainer = transformers.Trainer(model=model, args=args, train_dataset=TokenDataset(),
                                           optimizer_cls_and_kwargs=fira_optimizer_cls_and_kwargs(model, args))
        else:
            trainer = FiraTrainer(model=model, args=args, train_dataset=TokenDataset())
        trainer.train()
        _fira(trainer)
        results.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    # The pair uses the ">= 2-D decays" default, the others the Trainer's list; with weight_decay=0 all agree.
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)
    torch.testing.assert_close(results[1], results[2], rtol=0, atol=0)
    with pytest.raises(ValueError, match="num_training_steps=0"):
        create_fira_optimizer_and_scheduler(tiny_llama(), args, num_training_steps=0)


def test_step_in_backward_through_the_trainer_equals_its_usual_step(tmp_path):
    """With gradient accumulation: the non-final micro-batches accumulate under the handle
    (without it every micro-batch updated: 6 updates in 3 steps), and the weights equal the
    usual step's bit for bit."""
    weights = []
    for in_backward in (False, True):
        model = tiny_llama()
        args = training_args(tmp_path / str(in_backward), max_steps=3, gradient_accumulation_steps=2,
                             max_grad_norm=0.0)
        trainer = FiraTrainer(model=model, args=args, train_dataset=TokenDataset(), step_in_backward=in_backward)
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # no "updated twice" warning
            trainer.train()
        assert (trainer.in_backward is not None) == in_backward
        assert all(int(s["step"]) == 3 for s in _fira(trainer).state.values())
        # the gradients are freed by the time the Trainer would measure them: no norm, not a 0
        norms = [log["grad_norm"] for log in trainer.state.log_history if "grad_norm" in log]
        assert norms == [] if in_backward else (len(norms) == 3 and all(n > 0 for n in norms))
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(weights[0], weights[1])


@pytest.fixture
def gpu_like_fp16(monkeypatch):
    """accelerate's fp16 as on a GPU, where it makes a GradScaler (on the CPU it makes none and
    runs fp16 as fp32); without autocast here, so the loss is scaled and nothing else changes."""
    real = transformers.Trainer.create_accelerator_and_postprocess

    def with_scaler(self):
        real(self)
        if getattr(self.accelerator, "mixed_precision", None) == "fp16" and self.accelerator.scaler is None:
            self.accelerator.scaler = torch.amp.GradScaler("cpu")

    monkeypatch.setattr(transformers.Trainer, "create_accelerator_and_postprocess", with_scaler)


def test_step_in_backward_with_fp16_scales_the_loss_per_update_and_saves_the_scale(tmp_path, gpu_like_fp16):
    """fp16=True: the handle's LossScale stands in for the Trainer's GradScaler (which would find
    the gradients used). Both scale by 2**16 and divide back exactly (fp32 weights, no autocast
    here): the weights equal the usual step's bit for bit, with accumulation. The scale is the
    checkpoint's scaler.pt, which a GradScaler reads too, and a resume continues it."""
    weights = []
    for in_backward in (False, True):
        model = tiny_llama()
        args = training_args(tmp_path / str(in_backward), max_steps=4, gradient_accumulation_steps=2,
                             max_grad_norm=0.0, fp16=True, save_strategy="steps", save_steps=2)
        trainer = FiraTrainer(model=model, args=args, train_dataset=TokenDataset(), step_in_backward=in_backward)
        trainer.train()
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(weights[0], weights[1])
    assert trainer._loss_scale.handle is None  # the handle was removed when train() returned
    saved = torch.load(tmp_path / "True" / "checkpoint-2" / "scaler.pt", weights_only=True)
    assert saved["scale"] == 2.0 ** 16 and saved["_growth_tracker"] == 2
    resumed_model = tiny_llama(seed=123)
    resumed = FiraTrainer(model=resumed_model, args=args, train_dataset=TokenDataset(), step_in_backward=True)
    resumed.train(resume_from_checkpoint=str(tmp_path / "True" / "checkpoint-2"))
    assert resumed._loss_scale.state_dict()["_growth_tracker"] == 4  # 2 from the checkpoint + 2 steps
    assert torch.equal(torch.cat([p.detach().flatten() for p in resumed_model.parameters()]), weights[1])
    # the scaler.pt also resumes the Trainer without step_in_backward (its GradScaler)
    plain = FiraTrainer(model=tiny_llama(seed=123), args=args, train_dataset=TokenDataset())
    plain.train(resume_from_checkpoint=str(tmp_path / "True" / "checkpoint-2"))
    assert plain.accelerator.scaler.get_scale() == 2.0 ** 16


def test_step_in_backward_scales_under_accelerate_s_fp16_and_each_accelerator_anew(tmp_path, monkeypatch,
                                                                                   gpu_like_fp16):
    # `accelerate launch --mixed_precision fp16` leaves args.fp16 False: the Trainer's GradScaler
    # would then have met the used gradients
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    args = training_args(tmp_path, max_steps=2, max_grad_norm=0.0)
    trainer = FiraTrainer(model=tiny_llama(), args=args, train_dataset=TokenDataset(), step_in_backward=True)
    assert not args.fp16 and trainer._loss_scale is not None
    assert trainer.accelerator.scaler.loss_scale is trainer._loss_scale
    first = trainer._loss_scale
    trainer.create_accelerator_and_postprocess()  # a new hyperparameter-search trial: a new scale
    assert trainer._loss_scale is not first and trainer.accelerator.scaler.loss_scale is trainer._loss_scale


def _trainer_ddp_worker(rank: int, world_size: int, out: str, compiled: bool) -> dict:
    # The environment torchrun gives each process: the Trainer (accelerate) then runs DDP on gloo
    os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    weights, steps = {}, {}
    compile_args = {"torch_compile": True, "torch_compile_backend": "eager"} if compiled else {}
    for in_backward in (False, True):
        model = tiny_llama()
        args = training_args(Path(out) / str(in_backward), max_steps=3, gradient_accumulation_steps=2,
                             max_grad_norm=0.0, per_device_train_batch_size=2, **compile_args)
        trainer = FiraTrainer(model=model, args=args, train_dataset=TokenDataset(), step_in_backward=in_backward)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", "step_in_backward", UserWarning)  # no "updated twice" warning
            trainer.train()
            # again, on the same DDP wrapper: its communication hook is taken over, not registered twice
            trainer.train()
        wrapped = getattr(trainer.model_wrapped, "_orig_mod", trainer.model_wrapped)  # torch.compile's wrapper
        assert isinstance(wrapped, torch.nn.parallel.DistributedDataParallel)
        assert (wrapped is not trainer.model_wrapped) == compiled
        if in_backward:
            assert trainer.in_backward.model is wrapped
        steps[str(in_backward)] = sorted({int(s["step"]) for s in _fira(trainer).state.values()})
        weights[str(in_backward)] = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {"weights": weights, "steps": steps}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("compiled", [False, True])
def test_step_in_backward_through_the_trainer_under_ddp_equals_its_usual_step(tmp_path, compiled):
    """Under DDP (two gloo processes) the hooks go on the model the Trainer wrapped, after the
    optimizer was built: each update uses the all-reduced gradient (it was refused before). With
    torch_compile the Trainer hands training_step the compiled wrapper of the DDP model: hooks on
    the local gradients then trained each rank on its own, and the ranks drifted apart."""
    results = run_ranks(_trainer_ddp_worker, 2, tmp_path, str(tmp_path), compiled, timeout=170)
    for result in results:
        assert result["steps"] == {"False": [6], "True": [6]}
        assert torch.equal(result["weights"]["False"], result["weights"]["True"])
    assert torch.equal(results[0]["weights"]["True"], results[1]["weights"]["True"])  # the ranks agree


def test_step_in_backward_hooks_an_optimizer_given_to_the_trainer(tmp_path):
    """optimizers=(fira, None) with step_in_backward=True trained with plain steps, silently."""
    model = tiny_llama()
    args = training_args(tmp_path, max_steps=2, max_grad_norm=0.0)
    optimizer = FiraAdamW(model.parameters(), lr=1e-2, rank=4)
    trainer = FiraTrainer(model=model, args=args, train_dataset=TokenDataset(), optimizers=(optimizer, None),
                          step_in_backward=True)
    handle = step_in_backward(optimizer)  # made before the Trainer saw the optimizer: adopted, left to its owner
    trainer.train()
    assert trainer.in_backward is handle and optimizer._in_backward is handle and handle._active
    handle.remove()
    trainer = FiraTrainer(model=model, args=args, train_dataset=TokenDataset(), optimizers=(optimizer, None),
                          step_in_backward=True)
    trainer.train()
    assert trainer.in_backward.optimizer is optimizer
    adamw = torch.optim.AdamW(tiny_llama().parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="needs a fira_optim optimizer, got AdamW"):
        FiraTrainer(model=tiny_llama(), args=args, train_dataset=TokenDataset(), optimizers=(adamw, None),
                    step_in_backward=True).train()


@pytest.mark.parametrize(("overrides", "message"), [
    ({}, r"needs TrainingArguments\(max_grad_norm=0\), got max_grad_norm=1.0"),
])
def test_step_in_backward_refuses_what_it_cannot_honour(tmp_path, overrides, message):
    args = training_args(tmp_path, **overrides)
    with pytest.raises(ValueError, match=message):
        FiraTrainer(model=tiny_llama(), args=args, train_dataset=TokenDataset(), step_in_backward=True)


def test_step_in_backward_refuses_clipping_set_after_the_trainer_was_built(tmp_path):
    """max_grad_norm was checked in __init__ only: set afterwards (trainer.args, or a
    hyperparameter_search trial, which sets the TrainingArguments in train()), the Trainer
    clipped the freed gradients and logged grad_norm 0 at every step."""
    model = tiny_llama()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = FiraTrainer(model=model, args=training_args(tmp_path, max_steps=2, max_grad_norm=0.0),
                          train_dataset=TokenDataset(), step_in_backward=True)
    trainer.args.max_grad_norm = 1.0
    with pytest.raises(ValueError, match=r"needs TrainingArguments\(max_grad_norm=0\), got max_grad_norm=1.0"):
        trainer.train()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # refused before any update


def test_fira_trainer_refuses_an_optimizer_class_it_would_ignore(tmp_path):
    """FiraTrainer(optimizer_cls_and_kwargs=(SGD, ...)), or the kwargs of
    fira_optimizer_cls_and_kwargs(model, args, variant="galore"), trained FiraAdamW from the
    TrainingArguments, the class and its keywords ignored without a word."""
    args = training_args(tmp_path, max_steps=1)
    model = tiny_llama()
    for given in ((torch.optim.SGD, {"lr": 0.1}), fira_optimizer_cls_and_kwargs(model, args, variant="galore")):
        with pytest.raises(ValueError, match=r"FiraTrainer builds its FiraAdamW from the TrainingArguments and "
                                             r"fira_options: optimizer_cls_and_kwargs=\((SGD|FiraAdamW), \.\.\.\) would be "
                                             r"ignored"):
            FiraTrainer(model=model, args=args, train_dataset=TokenDataset(), optimizer_cls_and_kwargs=given)


def test_step_in_backward_follows_an_optimizer_the_trainer_replaced(tmp_path):
    """The handle was made once: after the Trainer built another optimizer (auto_find_batch_size,
    model_init) the hooks stayed on the old one and the new one trained in step(), or not at all."""
    model = tiny_llama()
    trainer = FiraTrainer(model=model, args=training_args(tmp_path, max_grad_norm=0.0), train_dataset=TokenDataset(),
                          step_in_backward=True)
    trainer.create_optimizer()
    trainer._hook_in_backward(model)
    first = trainer.in_backward
    assert first.optimizer is trainer.optimizer and trainer.optimizer._in_backward is first
    trainer._hook_in_backward(model)
    assert trainer.in_backward is first  # nothing changed: the same handle
    old = trainer.optimizer
    trainer.optimizer = None
    trainer.create_optimizer()
    trainer._hook_in_backward(model)
    assert trainer.in_backward is not first and trainer.in_backward.optimizer is trainer.optimizer
    assert old._in_backward is None and not first._hooks  # the old hooks are gone


def test_a_second_trainer_on_the_same_model_updates_each_weight_once(tmp_path):
    """The first Trainer's hooks stayed on the weights after its train(): a second Trainer's
    hooks then updated every weight a second time in each backward, silently."""
    model = tiny_llama()
    args = training_args(tmp_path, max_steps=2, max_grad_norm=0.0)
    first = FiraTrainer(model=model, args=args, train_dataset=TokenDataset(), step_in_backward=True)
    first.train()
    assert not first.in_backward._active and _fira(first)._in_backward is None  # removed when train() returned
    twin = copy.deepcopy(model)
    second = FiraTrainer(model=model, args=args, train_dataset=TokenDataset(), step_in_backward=True)
    second.train()
    plain = FiraTrainer(model=twin, args=args, train_dataset=TokenDataset())  # the same steps, after backward
    plain.train()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    # any two handles over the same weights: refused (each backward would update them twice)
    a = FiraAdamW(model.parameters(), rank=4)
    handle = step_in_backward(a)
    with pytest.raises(ValueError, match="already updated in the backward pass by the handle of another FiraAdamW"):
        step_in_backward(FiraAdamW(model.parameters(), rank=4))
    handle.remove()
    step_in_backward(FiraAdamW(model.parameters(), rank=4)).remove()
    embedding = FiraAdamW([model.model.embed_tokens.weight], rank=None)
    head = FiraAdamW([model.lm_head.weight], rank=None)
    handles = [step_in_backward(embedding), step_in_backward(head)]
    with pytest.raises(ValueError, match="already updated in the backward pass"):  # refused, and not kept
        head.add_param_group({"params": [model.model.embed_tokens.weight]})
    assert len(head.param_groups) == 1
    for handle in handles:
        handle.remove()


def test_step_in_backward_refuses_several_processes_without_ddp(tmp_path):
    # Tensor parallelism, XLA or SageMaker: no DDP wrapper, so hooks would use the local gradients
    model = tiny_llama()
    fake = SimpleNamespace(optimizer=FiraAdamW(model.parameters(), rank=4), in_backward=None,
                           args=SimpleNamespace(world_size=2, max_grad_norm=0.0), is_fsdp_enabled=False,
                           is_deepspeed_enabled=False)
    with pytest.raises(ValueError, match="world_size=2 needs the model wrapped in DistributedDataParallel, "
                                         "got LlamaForCausalLM"):
        FiraTrainer._hook_in_backward(fake, model)


@pytest.mark.parametrize("backend", ["fsdp", "deepspeed"])
def test_step_in_backward_refuses_fsdp_and_deepspeed(tmp_path, backend):
    # They need several processes to build; the check reads what the Trainer found
    trainer = SimpleNamespace(args=training_args(tmp_path, max_grad_norm=0.0), is_fsdp_enabled=backend == "fsdp",
                              is_deepspeed_enabled=backend == "deepspeed")
    with pytest.raises(ValueError, match="cannot run under " + {"fsdp": "FSDP", "deepspeed": "DeepSpeed"}[backend]):
        _check_step_in_backward(trainer)


def test_checkpoint_resume_continues_identically(tmp_path):
    """Train 6 steps saving at 3; a fresh Trainer resumed from checkpoint-3 ends with the same weights.

    update_proj_gap=2 makes the resumed run refresh its bases (steps 4 and 6) from the restored state,
    and the Trainer loads optimizer.pt with torch.load(weights_only=True).
    """
    out = tmp_path / "run"
    args = training_args(out, save_strategy="steps", save_steps=3, max_steps=6)
    reference = tiny_llama()
    trainer = FiraTrainer(model=reference, args=args, train_dataset=TokenDataset())
    trainer.train()
    checkpoint = out / "checkpoint-3"
    assert (checkpoint / "optimizer.pt").is_file()
    state = torch.load(checkpoint / "optimizer.pt", weights_only=True)  # what the Trainer does
    assert any("basis" in s for s in state["state"].values())

    resumed_model = tiny_llama(seed=123)  # different init: everything must come from the checkpoint
    resumed = FiraTrainer(model=resumed_model, args=args, train_dataset=TokenDataset())
    resumed.train(resume_from_checkpoint=str(checkpoint))
    for (name, p), q in zip(reference.named_parameters(), resumed_model.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert _final_losses(resumed)[-1] == pytest.approx(_final_losses(trainer)[-1], rel=1e-5)


def test_checkpoint_resume_differs_without_optimizer_state(tmp_path):
    """Control for the test above: dropping optimizer.pt changes the result, so the state matters."""
    out = tmp_path / "run"
    args = training_args(out, save_strategy="steps", save_steps=3, max_steps=6)
    reference = tiny_llama()
    FiraTrainer(model=reference, args=args, train_dataset=TokenDataset()).train()
    (out / "checkpoint-3" / "optimizer.pt").unlink()
    other = tiny_llama()
    FiraTrainer(model=other, args=args, train_dataset=TokenDataset()).train(
        resume_from_checkpoint=str(out / "checkpoint-3"))
    diff = max((p - q).abs().max().item() for p, q in zip(reference.parameters(), other.parameters()))
    assert diff > 1e-4


# ---------------------------------------------------------------- LoRA adapters + Fira


def test_fira_on_lora_adapters_projects_the_lora_rank(tmp_path):
    peft = pytest.importorskip("peft")
    model = tiny_llama()
    lora = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "up_proj"],
                           task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, lora)
    names = target_parameter_names(model, ["lora_A", "lora_B"])
    assert len(names) == 2 * 3 * 2 and all(".lora_" in n for n in names)
    # Frozen base weights never enter the optimizer even when a pattern matches them.
    assert not any(n.endswith("base_layer.weight") for n in target_parameter_names(model, "all-linear"))

    args = training_args(tmp_path, max_steps=4, optim_target_modules=["lora_A", "lora_B"], optim_args="rank=4")
    trainer = FiraTrainer(model=model, args=args, train_dataset=TokenDataset())
    trainer.train()
    assert all(math.isfinite(x) for x in _final_losses(trainer))
    lora_params = dict(model.named_parameters())
    for name in names:
        p = lora_params[name]
        state = _fira(trainer).state[p]
        # lora_A is r x n (left projection), lora_B is m x r (right): the LoRA rank side is compressed 8 -> 4.
        expected = (4, p.shape[1]) if ".lora_A." in name else (p.shape[0], 4)
        assert tuple(state["exp_avg"].shape) == expected, name
    fira_numel = optimizer_state_numel(_fira(trainer))
    adam_moments = 2 * sum(lora_params[n].numel() for n in names)
    basis = sum(8 * 4 for _ in names)  # one r x rank basis per adapter matrix
    assert fira_numel == adam_moments // 2 + basis + len(names)  # + one limiter norm each

    # Rank >= the LoRA rank: nothing to compress, the library updates the adapters with plain Adam.
    plain = create_fira_optimizer(model, args, optim_args="rank=8")
    model(input_ids=TokenDataset()[0]["input_ids"][None], labels=TokenDataset()[0]["labels"][None]).loss.backward()
    plain.step()
    assert optimizer_state_numel(plain) == adam_moments


def test_step_in_backward_with_fp16_on_the_cpu_is_unscaled_as_accelerate_runs_it(tmp_path):
    args = training_args(tmp_path, max_steps=2, max_grad_norm=0.0, fp16=True)
    trainer = FiraTrainer(model=tiny_llama(), args=args, train_dataset=TokenDataset(), step_in_backward=True)
    assert trainer.accelerator.scaler is None and trainer._loss_scale is None
    trainer.train()
    assert trainer.state.global_step == 2 and trainer.in_backward.loss_scale is None


def test_fira_options_may_give_the_decayed_parameters(tmp_path):
    """fira_options={"decay_parameter_names": [...]} raised a TypeError (the Trainer's own list was
    passed too); the user's list now replaces the Trainer's rule."""
    model = tiny_llama()
    args = training_args(tmp_path, weight_decay=0.1, max_steps=1)
    decayed = ["model.layers.0.self_attn.q_proj.weight", "model.norm.weight"]
    trainer = FiraTrainer(model=model, args=args, train_dataset=TokenDataset(),
                          fira_options={"decay_parameter_names": decayed})
    optimizer = trainer.create_optimizer()
    names = {p: n for n, p in model.named_parameters()}
    with_decay = {names[p] for g in optimizer.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert with_decay == set(decayed)


def test_decay_parameter_names_that_name_no_parameter_are_refused(tmp_path):
    """A misspelt name ('model.norm.wieght') or a single string (read as its characters) in
    decay_parameter_names decayed nothing there, without a word; the Trainer's own list, which
    also names a tied weight by its second name, is still taken as it is."""
    model = tiny_llama()
    args = training_args(tmp_path, weight_decay=0.1, max_steps=1)
    with pytest.raises(ValueError, match=r"decay_parameter_names names no parameter of LlamaForCausalLM: "
                                         r"\['model.norm.wieght'\]"):
        create_fira_optimizer(model, args, decay_parameter_names=["model.norm.weight", "model.norm.wieght"])
    with pytest.raises(TypeError, match=r"decay_parameter_names must be a list of parameter names, got "
                                        r"'model.norm.weight'"):
        trainer_param_groups(model, ["q_proj"], weight_decay=0.1, decay_parameter_names="model.norm.weight", rank=4)
    tied = tiny_llama(tie=True)
    trainer = FiraTrainer(model=tied, args=args, train_dataset=TokenDataset())
    assert "lm_head.weight" in trainer.get_decay_parameter_names(tied)  # the tied head's second name
    trainer.create_optimizer()
