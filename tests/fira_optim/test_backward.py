"""fira_optim.step_in_backward: updates inside the backward pass equal optimizer.step()."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from fira_optim import VARIANTS, FiraAdamW, step_in_backward
from tests.multiprocess import run_ranks


class Net(torch.nn.Module):
    """Wide, tall and square projected matrices, a bias and a norm weight (plain AdamW)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(10, 14)  # weight 14 x 10: right
        self.b = torch.nn.Linear(14, 9)  # 9 x 14: left
        self.c = torch.nn.Linear(9, 9, bias=False)  # square: right
        self.norm = torch.nn.LayerNorm(9)

    def forward(self, x):
        return self.norm(self.c(torch.tanh(self.b(torch.tanh(self.a(x))))))


def _net(dtype=torch.float64):
    torch.manual_seed(0)
    return Net().to(dtype)


def _optimizer(model, variant="fira", **options):
    matrices = [m.weight for m in (model.a, model.b, model.c)]
    ids = {id(p) for p in matrices}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return FiraAdamW([{"params": matrices, "rank": 3, "update_proj_gap": 3},
                      {"params": rest}], lr=0.02, weight_decay=0.1, **VARIANTS[variant], **options)


def _batch(step, micro=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(100 * step + micro)
    x = torch.randn(8, 10, generator=g, dtype=torch.float64).to(dtype)
    return x, (1.0 + step) * torch.randn(8, 9, generator=g, dtype=torch.float64).to(dtype)


def _loss(model, x, y):
    return (model(x) - y).square().mean()


def _train(model, opt, steps, micro_batches=1, handle=None, scheduler=None):
    for step in range(steps):
        for micro in range(micro_batches):
            x, y = _batch(step, micro, next(model.parameters()).dtype)
            last = micro == micro_batches - 1
            context = handle.accumulate() if handle is not None and not last else _nothing()
            with context:
                (_loss(model, x, y) / micro_batches).backward()
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


#: bf16 states written by stochastic rounding, of fp32 weights and of bf16 weights rounded so too
STOCHASTIC_STATES = {"state_dtype": "bfloat16", "state_rounding": "stochastic"}


@pytest.mark.parametrize("variant,dtype,options", [
    ("fira", torch.float64, {}), ("galore", torch.float64, {}), ("fira-matrix", torch.float64, {}),
    ("fira", torch.float32, STOCHASTIC_STATES),
    ("fira", torch.bfloat16, {**STOCHASTIC_STATES, "stochastic_rounding": True})])
def test_updates_in_backward_equal_step_bit_for_bit(variant, dtype, options):
    runs = []
    for in_backward in (False, True):
        model = _net(dtype)
        opt = _optimizer(model, variant, **options)
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        handle = step_in_backward(opt) if in_backward else None
        _train(model, opt, 7, scheduler=scheduler)  # refreshes at steps 0, 3, 6
        runs.append((model, opt))
        if handle is not None:
            assert all(p.grad is None for p in model.parameters())  # freed as they were used
    (m1, o1), (m2, o2) = runs
    for p, q in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p, q)
    for p, q in zip(m1.parameters(), m2.parameters()):
        for key, value in o1.state[p].items():
            assert torch.equal(value, o2.state[q][key]), key


@pytest.mark.parametrize("stagger", [False, True])
def test_bases_of_matrices_of_hundreds_of_rows_are_those_of_the_plain_step_on_any_thread_count(stagger):
    """LAPACK's SVD of a 256 x 256 gradient differs with the thread count; several refreshes due
    together ran on one thread each, a lone one (each update in the backward pass; a staggered
    step) on all of them: the weights differed from the plain step's at about 1e-4, and a
    staggered run from itself on a machine with another core count."""
    def run(in_backward, threads):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 256, bias=False), torch.nn.Tanh(),
                                    torch.nn.Linear(256, 256, bias=False))
        opt = FiraAdamW([{"params": list(model.parameters()), "rank": 32, "update_proj_gap": 2,
                          "stagger": stagger}], lr=0.01)
        if in_backward:
            step_in_backward(opt)
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            for s in range(4):
                x = torch.randn(64, 256, generator=torch.Generator().manual_seed(s))
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
        finally:
            torch.set_num_threads(before)
        return [p.detach().clone() for p in model.parameters()]

    plain = run(False, 2)
    for in_backward, threads in [(True, 2), (False, 1), (True, 1)]:
        assert all(torch.equal(p, q) for p, q in zip(plain, run(in_backward, threads))), (in_backward, threads)


def test_gradient_accumulation_updates_on_the_last_micro_batch():
    runs = []
    for in_backward in (False, True):
        model = _net()
        opt = _optimizer(model)
        handle = step_in_backward(opt) if in_backward else None
        _train(model, opt, 4, micro_batches=3, handle=handle)
        runs.append(model)
    for p, q in zip(*(m.parameters() for m in runs)):
        assert torch.equal(p, q)


def test_accumulating_without_accumulate_warns_once_that_each_backward_updated():
    """A Trainer with gradient_accumulation_steps=2 updated every micro-batch, silently."""
    model = _net()
    opt = _optimizer(model)
    handle = step_in_backward(opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the right loop warns of nothing
        _train(model, opt, 2, micro_batches=2, handle=handle)
    with pytest.warns(UserWarning, match=r"every backward outside handle.accumulate\(\) is a whole update") as caught:
        _train(model, opt, 2, micro_batches=2)  # no accumulate(): four updates in two steps
    assert len(caught) == 1
    assert opt.state[model.a.weight]["step"] == 6


def test_a_final_micro_batch_inside_accumulate_is_updated_by_step():
    """A loop that runs every micro-batch under accumulate() (an older Trainer decides the last
    one after its backward): step() updates what accumulated, as the plain step does."""
    runs = []
    for in_backward in (False, True):
        model = _net()
        opt = _optimizer(model)
        handle = step_in_backward(opt) if in_backward else None
        for step in range(3):
            for micro in range(2):
                x, y = _batch(step, micro)
                with handle.accumulate() if handle is not None else _nothing():
                    (_loss(model, x, y) / 2).backward()
            opt.step()
            opt.zero_grad()
        runs.append(model)
    for p, q in zip(*(m.parameters() for m in runs)):
        assert torch.equal(p, q)


def test_a_backward_abandoned_for_a_non_finite_gradient_is_no_accumulation():
    """Catching the error and training on (no step() for the abandoned batch) warned that the
    loop accumulated without accumulate()."""
    from fira_optim import NonFiniteGradientError

    model = _net()
    opt = _optimizer(model)
    step_in_backward(opt)
    x, y = _batch(0)
    with pytest.raises(NonFiniteGradientError, match="; nothing was updated"):
        (_loss(model, x, y) * float("nan")).backward()  # the first gradient completed is NaN
    opt.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _loss(model, x, y).backward()
        opt.step()


def test_a_non_finite_gradient_raised_in_the_backward_pass_says_which_updates_were_kept():
    """It said 'nothing was updated' while the weights whose gradients completed before it had
    been."""
    from fira_optim import NonFiniteGradientError

    model = _net()
    opt = _optimizer(model)
    step_in_backward(opt)
    before = [p.detach().clone() for p in model.parameters()]
    model.a.weight.register_hook(lambda grad: grad * float("nan"))  # the first layer: completed last
    with pytest.raises(NonFiniteGradientError, match=r"non-finite gradient in param_groups\[0\]\['params'\]\[0\]") as caught:
        _loss(model, *_batch(0)).backward()
    changed = sum(not torch.equal(p, q) for p, q in zip(before, model.parameters()))
    assert torch.equal(before[0], model.a.weight) and changed >= 1  # a.weight alone kept as it was
    assert (f"this parameter was not updated, but the {changed} others updated in the backward pass since the last "
            "optimizer.step() keep their update") in str(caught.value)


def test_a_second_handle_says_how_to_reach_the_first_one_not_kept():
    """A notebook cell run twice made a second handle; the first, not kept, could be removed
    through the optimizer only, which the error did not say."""
    model = _net()
    opt = _optimizer(model)
    step_in_backward(opt)  # not kept
    with pytest.raises(RuntimeError, match=r"already active on this optimizer; remove\(\) its handle first "
                                           r"\(optimizer.in_backward.remove\(\)"):
        step_in_backward(opt)
    with pytest.raises(ValueError, match=r"by the handle of another FiraAdamW .* remove\(\) that handle first "
                                         r"\(that optimizer's in_backward.remove\(\)"):
        step_in_backward(_optimizer(model))
    opt.in_backward.remove()
    step_in_backward(_optimizer(model))


def test_step_is_a_no_op_and_remove_restores_it():
    model = _net()
    opt = _optimizer(model)
    handle = step_in_backward(opt)
    with pytest.raises(RuntimeError, match="already active"):
        step_in_backward(opt)
    x, y = _batch(0)
    _loss(model, x, y).backward()  # the update happens here
    after_backward = copy.deepcopy(list(model.parameters()))
    opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), after_backward))
    handle.remove()
    _loss(model, x, y).backward()
    assert all(p.grad is not None for p in model.parameters())  # no hook frees them any more
    opt.step()
    assert not any(torch.equal(p, q) for p, q in zip(model.parameters(), after_backward))



@pytest.mark.parametrize("change", ["add_param_group", "unfreeze"])
def test_parameters_no_hook_covered_yet_are_trained_as_by_step(change):
    # A group added after step_in_backward, and a weight frozen then and unfrozen since, are
    # trained exactly as without it (they used to be left untouched: step() did nothing).
    runs = []
    for in_backward in (False, True):
        model = _net()
        matrices = [model.a.weight, model.b.weight]
        later = model.c.weight if change == "add_param_group" else model.b.weight
        if change == "unfreeze":
            later.requires_grad_(False)
        rest = [p for p in model.parameters() if all(p is not q for q in (model.a.weight, model.b.weight,
                                                                           model.c.weight))]
        opt = FiraAdamW([{"params": matrices, "rank": 3, "update_proj_gap": 3}, {"params": rest}],
                        lr=0.02, weight_decay=0.1)
        if in_backward:
            step_in_backward(opt)
        _train(model, opt, 2)
        if change == "add_param_group":
            opt.add_param_group({"params": [later], "rank": 3, "update_proj_gap": 3})
        else:
            later.requires_grad_(True)
        _train(model, opt, 4)
        runs.append(model)
    for p, q in zip(*(m.parameters() for m in runs)):
        assert torch.equal(p, q)


@pytest.mark.parametrize("change", ["removed", "replaced"])
def test_a_weight_taken_out_of_its_group_is_left_alone_as_by_step(change):
    # A weight removed from its group's list (or replaced there by another tensor) while the model
    # still trains it is no longer this optimizer's: step() leaves it and its gradient alone, and
    # so does its hook (its update failed inside backward with a KeyError printing the tensor).
    runs = []
    for in_backward in (False, True):
        model = _net()
        opt = _optimizer(model)
        if in_backward:
            step_in_backward(opt)
        _train(model, opt, 2)
        group = opt.param_groups[0]
        if change == "removed":
            del group["params"][1]  # model.b.weight
        else:
            group["params"][1] = torch.nn.Parameter(model.b.weight.detach().clone())
        before = model.b.weight.detach().clone()
        x, y = _batch(2)
        _loss(model, x, y).backward()
        gradient = model.b.weight.grad
        opt.step()
        assert torch.equal(model.b.weight, before) and model.b.weight.grad is gradient is not None
        opt.zero_grad()
        model.b.weight.grad = None
        _train(model, opt, 2)
        runs.append(model)
    for p, q in zip(*(m.parameters() for m in runs)):
        assert torch.equal(p, q)


def test_a_group_added_is_hooked_at_once_and_an_unfrozen_weight_after_one_step():
    x, y = _batch(0)
    model = _net()
    opt = FiraAdamW([{"params": [model.a.weight, model.b.weight], "rank": 3}], lr=0.02)
    step_in_backward(opt)
    opt.add_param_group({"params": [model.c.weight], "rank": 3})
    before = model.c.weight.detach().clone()
    _loss(model, x, y).backward()
    assert model.c.weight.grad is None and not torch.equal(model.c.weight, before)  # in the backward pass

    model = _net()
    model.b.weight.requires_grad_(False)
    opt = _optimizer(model)
    step_in_backward(opt)
    model.b.weight.requires_grad_(True)
    _loss(model, x, y).backward()
    assert model.b.weight.grad is not None  # no hook yet: step() updates it, then hooks it
    opt.step()
    assert int(opt.state[model.b.weight]["step"]) == 1
    opt.zero_grad()
    _loss(model, x, y).backward()
    assert model.b.weight.grad is None and int(opt.state[model.b.weight]["step"]) == 2


def test_two_losses_of_one_forward_pass_update_as_step_with_the_first_backward_inside_accumulate():
    """The recipe the docs give for backward passes through one retained graph, and the torch
    error they quote for the loop without it."""
    runs = []
    for in_backward in (False, True):
        model = _net()
        opt = _optimizer(model)
        handle = step_in_backward(opt) if in_backward else None
        for step in range(4):
            x, y = _batch(step)
            out = model(x)
            with handle.accumulate() if handle is not None else _nothing():
                (out - y).square().mean().backward(retain_graph=True)
            out.abs().mean().backward()
            opt.step()
            opt.zero_grad()
        runs.append(model)
    for p, q in zip(*(m.parameters() for m in runs)):
        assert torch.equal(p, q)
    out = runs[1](x)
    (out - y).square().mean().backward(retain_graph=True)  # outside accumulate(): updates the weights out needs
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.abs().mean().backward()


def test_a_tied_weight_listed_twice_is_refused_naming_both_places():
    """An embedding tied to its head, listed for each module: step() updates it twice a step (as
    torch's optimizers do), and the backward pass hooked it twice, the second hook warning of a
    repeated backward; the weights differed from step()'s without a clear word."""
    embedding = torch.nn.Embedding(12, 6)
    head = torch.nn.Linear(6, 12, bias=False)
    head.weight = embedding.weight
    with pytest.warns(UserWarning, match="duplicate parameters"):  # torch's own
        opt = FiraAdamW([*embedding.parameters(), *head.parameters()], rank=None)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\] \(shape \(12, 6\)\) is the same "
                                         r"tensor as param_groups\[0\]\['params'\]\[0\].*list it once"):
        step_in_backward(opt)
    assert opt.in_backward is None and not embedding.weight._post_accumulate_grad_hooks  # nothing hooked

    model = _net()
    opt = _optimizer(model)
    handle = step_in_backward(opt)
    with pytest.warns(UserWarning, match="duplicate parameters"), \
            pytest.raises(ValueError, match=r"param_groups\[2\]\['params'\]\[1\] .* is the same tensor as "
                                            r"param_groups\[2\]\['params'\]\[0\]"):
        opt.add_param_group({"params": [embedding.weight, embedding.weight]})
    assert len(opt.param_groups) == 2 and embedding.weight not in handle._covered


def _ddp_unfrozen_worker(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel

    model = _net()
    wrapped = DistributedDataParallel(model, find_unused_parameters=True)  # b.weight is reduced
    model.b.weight.requires_grad_(False)  # frozen when the hooks are registered, unfrozen later
    opt = _optimizer(model)
    step_in_backward(opt, wrapped)
    counts = []
    for step in range(3):
        if step == 1:
            model.b.weight.requires_grad_(True)
        x, y = _batch(step)
        _loss(wrapped, x, y).backward()
        opt.step()
        opt.zero_grad()
        counts.append({name: int(opt.state[p]["step"]) if opt.state.get(p) else 0
                       for name, p in model.named_parameters()})
    return counts


@pytest.mark.timeout(120)
def test_under_ddp_a_weight_unfrozen_later_is_updated_once_per_step(tmp_path):
    # DDP's communication hook updates every parameter it reduces, b.weight included once it has
    # a gradient again: step() must not update it a second time (it did, every step)
    (counts,) = run_ranks(_ddp_unfrozen_worker, 1, tmp_path, timeout=100)
    assert [c["b.weight"] for c in counts] == [0, 1, 2]
    assert [c["a.weight"] for c in counts] == [1, 2, 3]


def _ddp_unfrozen_before_worker(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel

    model = _net()
    model.b.weight.requires_grad_(False)  # frozen when DDP is built: DDP never reduces it
    wrapped = DistributedDataParallel(model)
    model.b.weight.requires_grad_(True)  # unfrozen before the handle is made
    opt = _optimizer(model)
    step_in_backward(opt, wrapped)
    for step in range(2):
        x, y = _batch(step)
        _loss(wrapped, x, y).backward()
        opt.step()
        opt.zero_grad()
    return {name: int(opt.state[p]["step"]) if opt.state.get(p) else 0 for name, p in model.named_parameters()}


@pytest.mark.timeout(120)
def test_under_ddp_a_weight_ddp_does_not_reduce_is_updated_by_step(tmp_path):
    # not in DDP's buckets: optimizer.step() updates it from its local gradient, as without the
    # handle (taken as covered by the communication hook, it was never updated)
    (counts,) = run_ranks(_ddp_unfrozen_before_worker, 1, tmp_path, timeout=100)
    assert counts["b.weight"] == 2 and counts["a.weight"] == 2


def _ddp_model_not_given_worker(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel

    errors = []
    for given in (None, "inner"):
        model = _net()
        wrapped = DistributedDataParallel(model)
        opt = _optimizer(model)
        handle = step_in_backward(opt, None if given is None else model)
        _loss(wrapped, *_batch(0)).backward()
        try:
            opt.step()
        except RuntimeError as err:
            errors.append((str(err), int(opt.state[model.a.weight]["step"])))
        handle.remove()
    model = _net()
    wrapped = DistributedDataParallel(model)
    opt = _optimizer(model)
    handle = step_in_backward(opt, torch.compile(wrapped))  # the wrapper of torch.compile(ddp_model)
    _loss(wrapped, *_batch(0)).backward()
    opt.step()
    return errors, handle.model is wrapped and int(opt.state[model.a.weight]["step"]) == 1


@pytest.mark.timeout(120)
def test_under_ddp_a_handle_without_the_ddp_model_is_refused_at_the_first_step(tmp_path):
    # Each hook updated from the local gradient, DDP's reducer then wrote the averaged one back,
    # and step() updated every weight from it a second time: the ranks diverged without a word
    ((errors, compiled_taken),) = run_ranks(_ddp_model_not_given_worker, 1, tmp_path, timeout=100)
    assert compiled_taken
    assert len(errors) == 2
    for (message, steps), given in zip(errors, ("model=None", "model=a Net")):
        assert "has a gradient at optimizer.step() after its update" in message
        assert f"step_in_backward(optimizer, ddp_model) (got {given})" in message
        assert steps == 1  # the second update refused


@pytest.mark.parametrize("block", ["accumulate", "paused"])
def test_a_backward_that_keeps_its_gradient_after_an_update_is_not_taken_for_a_gradient_written_back(block):
    model = _net()
    opt = _optimizer(model)
    handle = step_in_backward(opt)
    _loss(model, *_batch(0)).backward()
    with getattr(handle, block)():
        _loss(model, *_batch(1)).backward()
    opt.step()  # updates from the second batch's gradients, as it did
    assert int(opt.state[model.a.weight]["step"]) == 2


def _ddp_two_optimizers_worker(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel

    weights = {}
    for in_backward in (False, True):
        model = _net()
        wrapped = DistributedDataParallel(model)
        matrices = [model.a.weight, model.b.weight, model.c.weight]
        fira = FiraAdamW([{"params": matrices, "rank": 3, "update_proj_gap": 3}], lr=0.02, weight_decay=0.1)
        adamw = torch.optim.AdamW([p for p in model.parameters() if all(p is not q for q in matrices)], lr=0.01)
        if in_backward:
            step_in_backward(fira, wrapped)
        for step in range(4):
            _loss(wrapped, *_batch(step)).backward()
            fira.step()
            adamw.step()
            fira.zero_grad()
            adamw.zero_grad()
        weights[in_backward] = [p.detach().clone() for p in model.parameters()]
    return all(torch.equal(p, q) for p, q in zip(weights[False], weights[True]))


@pytest.mark.timeout(120)
def test_under_ddp_the_weights_of_another_optimizer_are_left_to_it(tmp_path):
    # Fira for the matrices, torch's AdamW for the rest of one DDP model: the communication hook
    # handed every weight of its bucket to Fira, and the backward pass failed with a KeyError
    (equal,) = run_ranks(_ddp_two_optimizers_worker, 1, tmp_path, timeout=100)
    assert equal


def _ddp_two_handles_worker(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel

    model = _net()
    wrapped = DistributedDataParallel(model)
    first = FiraAdamW([{"params": [model.a.weight], "rank": 3}])
    second = FiraAdamW([{"params": [model.b.weight], "rank": 3}])
    handle = step_in_backward(first, wrapped)
    try:
        step_in_backward(second, wrapped)
    except ValueError as err:
        refused = str(err)
    else:
        refused = ""
    handle.remove()
    step_in_backward(second, wrapped).remove()  # the wrapper is free again
    return refused


@pytest.mark.timeout(120)
def test_under_ddp_a_second_handle_on_the_same_model_is_refused_as_such(tmp_path):
    """DDP runs one communication hook per wrapper: a second handle, over other weights of the
    same model, was refused naming a weight of the first optimizer (of a shape the second does not
    even hold), as if both updated it."""
    (refused,) = run_ranks(_ddp_two_handles_worker, 1, tmp_path, timeout=100)
    assert "already run for another FiraAdamW (one handle per DDP model)" in refused, refused


def _ddp_every_micro_batch_accumulated_worker(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel

    model = _net()
    wrapped = DistributedDataParallel(model)
    opt = _optimizer(model)
    handle = step_in_backward(opt, wrapped)
    caught = []
    for step in range(2):
        for micro in range(2):
            with handle.accumulate() if step == 0 or micro == 0 else _nothing():
                (_loss(wrapped, *_batch(step, micro)) / 2).backward()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            opt.step()
        opt.zero_grad()
        caught.append([str(w.message) for w in seen])
    return caught, int(opt.state[model.a.weight]["step"])


@pytest.mark.timeout(120)
def test_under_ddp_a_step_whose_micro_batches_all_accumulated_warns_that_nothing_was_updated(tmp_path):
    # the final micro-batch inside accumulate(): no_sync all-reduced nothing, no hook updated, and
    # step() found no averaged gradients, so the step was lost without a word
    ((caught, steps),) = run_ranks(_ddp_every_micro_batch_accumulated_worker, 1, tmp_path, timeout=100)
    assert len(caught[0]) == 1 and "nothing was updated in this step" in caught[0][0]
    assert caught[1] == [] and steps == 1  # the next step, its final micro-batch synchronised: updated


def test_resume_in_backward_is_exact():
    model = _net()
    opt = _optimizer(model)
    step_in_backward(opt)
    _train(model, opt, 4)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    _train_from(model, opt, 4, 3)
    resumed = _net()
    resumed.load_state_dict(saved_model)
    resumed_opt = _optimizer(resumed)
    resumed_opt.load_state_dict(saved_opt)
    step_in_backward(resumed_opt)
    _train_from(resumed, resumed_opt, 4, 3)
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


def _train_from(model, opt, start, steps):
    for step in range(start, start + steps):
        x, y = _batch(step)
        _loss(model, x, y).backward()
        opt.step()


def test_paused_steps_as_without_the_handle_and_does_not_bring_back_a_removed_one():
    model = _net()
    opt = _optimizer(model)
    handle = step_in_backward(opt)
    with handle.paused():
        assert opt.in_backward is None
        _loss(model, *_batch(0)).backward()  # no hook updates: paused is for code that steps itself
        assert model.a.weight.grad is not None and not opt.state.get(model.a.weight)
        opt.step()
    assert opt.in_backward is handle and int(opt.state[model.a.weight]["step"]) == 1
    opt.zero_grad()
    with handle.paused():
        handle.remove()
    assert opt.in_backward is None  # removed inside the block: not put back
    with pytest.raises(RuntimeError, match="paused\\(\\) needs the handle that is active"):
        with handle.paused():
            pass
    assert step_in_backward(opt).optimizer is opt


def test_a_non_finite_gradient_skips_only_its_matrix():
    model = _net()
    opt = FiraAdamW([{"params": [model.a.weight, model.b.weight], "rank": 3}], nonfinite="skip")
    step_in_backward(opt)
    before = [model.a.weight.detach().clone(), model.b.weight.detach().clone()]
    model.a.weight.register_hook(lambda g: torch.full_like(g, float("nan")))
    x, y = _batch(0)
    with pytest.warns(RuntimeWarning, match="non-finite gradient"):
        _loss(model, x, y).backward()
    assert torch.equal(model.a.weight, before[0]) and not torch.equal(model.b.weight, before[1])


def test_non_finite_gradients_of_several_matrices_warn_once_a_step():
    """Each matrix is skipped on its own in the backward pass: one warning per matrix (22 for a
    tiny LLaMA's NaN step) where the step without the handle warns once."""
    model = _net()
    opt = FiraAdamW([{"params": [model.a.weight, model.b.weight], "rank": 3}], nonfinite="skip")
    step_in_backward(opt)
    for weight in (model.a.weight, model.b.weight):
        weight.register_hook(lambda g: torch.full_like(g, float("nan")))
    for _ in range(2):  # once in each step
        x, y = _batch(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _loss(model, x, y).backward()
            opt.step()
        skipped = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert len(skipped) == 1 and "its update skipped (and that of any other matrix" in skipped[0], skipped


# ---------------------------------------------------------------------- two processes


def _distributed_worker(rank, world, mode):
    import torch.distributed as dist

    model = _net()
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model, bucket_cap_mb=0.0001)  # several buckets
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in (model.a, model.b, model.c):
            fully_shard(layer)
        wrapped = fully_shard(model)
    opt = _optimizer(model)
    if mode == "fsdp2":  # each rank would find overflows in its own shard only
        with pytest.raises(ValueError, match="loss_scale does not run on sharded"):
            step_in_backward(opt, wrapped, loss_scale=1024.0)
        handle = step_in_backward(opt, wrapped)
    else:  # a static power of 2 in float64: unscaled exactly, as the unscaled one-process run
        handle = step_in_backward(opt, wrapped, loss_scale=1024.0)
    for step in range(5):
        for micro in range(2):
            x, y = _batch(step, micro)
            rows = slice(4 * rank, 4 * rank + 4)  # each rank its half of the batch
            context = handle.accumulate() if micro == 0 else _nothing()
            with context:
                loss = _loss(wrapped, x[rows], y[rows]) / 2
                (handle.scale(loss) if handle.loss_scale is not None else loss).backward()
        opt.step()
        opt.zero_grad()
    out = {}
    for name, p in model.named_parameters():
        out[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
    dist.barrier()
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_two_processes_equal_one(mode, tmp_path):
    model = _net()
    opt = _optimizer(model)
    _train(model, opt, 5, micro_batches=2)
    results = run_ranks(_distributed_worker, 2, tmp_path, mode, timeout=150)
    for result in results:
        for name, p in model.named_parameters():
            torch.testing.assert_close(result[name], p.detach(), rtol=1e-9, atol=1e-11)


class _SometimesSide(torch.nn.Module):
    """A weight ``side`` that the forward pass uses at some steps only (on some ranks only)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(6, 5, bias=False).double()
        self.side = torch.nn.Linear(6, 5, bias=False).double()
        self.use_side = True

    def forward(self, x):
        return self.a(x) + (self.side(x) if self.use_side else 0)


def _unused_worker(rank, world_size, in_backward, bucket_view):
    from torch.nn.parallel import DistributedDataParallel

    model = _SometimesSide()
    wrapped = DistributedDataParallel(model, find_unused_parameters=True, gradient_as_bucket_view=bucket_view)
    opt = FiraAdamW([{"params": [model.a.weight, model.side.weight], "rank": 2, "update_proj_gap": 2}],
                    lr=0.02, weight_decay=0.1)
    if in_backward:
        step_in_backward(opt, wrapped)
    # side: used by both ranks at step 0, by rank 0 only at step 2, by none at steps 1 and 3
    return _train_side(model, wrapped, opt, rank, 4, lambda step: step == 0 or (step == 2 and rank == 0))


def _train_side(model, wrapped, opt, rank, steps, uses_side) -> dict:
    """``steps`` steps of ``wrapped`` on each rank's own batch, ``side`` used where ``uses_side(step)``."""
    for step in range(steps):
        model.use_side = uses_side(step)
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank), dtype=torch.float64)
        (wrapped(x) ** 2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"side": model.side.weight.detach().clone(), "a": model.a.weight.detach().clone(),
            "side_steps": int(opt.state[model.side.weight]["step"])}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bucket_view", [False, True])
def test_under_ddp_a_weight_no_rank_used_is_not_updated_in_the_backward_pass(tmp_path, bucket_view):
    """find_unused_parameters=True: the bucket holds zeros for a weight that no rank used, and
    DDP leaves its gradient None, so a plain step leaves it alone; in the backward pass it was
    updated (weight decay and momentum moved it, its step count ran ahead). Used by one rank only,
    it is updated with the averaged gradient, as by a plain step."""
    plain = run_ranks(_unused_worker, 2, tmp_path / "plain", False, bucket_view, timeout=100)
    hooked = run_ranks(_unused_worker, 2, tmp_path / "hooked", True, bucket_view, timeout=100)
    for p, h in zip(plain, hooked):
        assert p["side_steps"] == h["side_steps"] == 2  # steps 0 and 2
        torch.testing.assert_close(h["side"], p["side"], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(h["a"], p["a"], rtol=1e-12, atol=1e-12)


def _static_worker(rank, world_size, in_backward):
    from torch.nn.parallel import DistributedDataParallel

    model = _SometimesSide()
    opt = FiraAdamW([{"params": [model.a.weight, model.side.weight], "rank": 2, "update_proj_gap": 2}],
                    lr=0.02, weight_decay=0.1)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(99), dtype=torch.float64)
    (model(x) ** 2).mean().backward()  # one step with side, the same on both ranks, before DDP
    opt.step()
    opt.zero_grad(set_to_none=True)
    model.use_side = False  # then never again: a static graph without it
    wrapped = DistributedDataParallel(model, static_graph=True)
    if in_backward:
        step_in_backward(opt, wrapped)
    return _train_side(model, wrapped, opt, rank, 3, lambda step: False)


@pytest.mark.timeout(120)
def test_under_ddp_static_graph_an_unused_weight_is_not_updated_in_the_backward_pass(tmp_path):
    """static_graph=True reduces a weight the graph does not use, as zeros, and leaves its gradient
    None, as find_unused_parameters=True does."""
    plain = run_ranks(_static_worker, 2, tmp_path / "plain", False, timeout=100)
    hooked = run_ranks(_static_worker, 2, tmp_path / "hooked", True, timeout=100)
    for p, h in zip(plain, hooked):
        assert p["side_steps"] == h["side_steps"] == 1
        torch.testing.assert_close(h["side"], p["side"], rtol=0, atol=0)
        torch.testing.assert_close(h["a"], p["a"], rtol=1e-12, atol=1e-12)


def _split_refresh_worker(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel

    model = _net()
    wrapped = DistributedDataParallel(model)
    opt = FiraAdamW([{"params": [model.a.weight, model.b.weight], "rank": 3}], lr=0.02, split_refresh=True)
    try:
        step_in_backward(opt, wrapped)
    except ValueError as err:
        return str(err)
    return "no error"


@pytest.mark.timeout(120)
def test_under_ddp_updates_in_the_backward_pass_refuse_split_refresh(tmp_path):
    """Its gathers and broadcasts, run inside DDP's communication hook between the buckets'
    all-reduces, hung every rank at the first refresh of a model with several buckets."""
    for message in run_ranks(_split_refresh_worker, 2, tmp_path, timeout=100):
        assert "split_refresh=True" in message and "build it with split_refresh=False" in message


def test_zero_grad_without_set_to_none_and_global_norm_clipping_under_the_handle():
    """Two torch idioms the docs speak of: with ``zero_grad(set_to_none=False)`` weights used in
    every step train as a plain step trains them, bit for bit (each update frees its gradient, so
    there is nothing to zero); ``clip_grad_norm_`` after a backward finds the gradients freed and
    returns 0, the updates being done (Fira's limiter bounds each matrix's update instead)."""
    plain_model, hooked_model = _net(), _net()
    plain, hooked = _optimizer(plain_model), _optimizer(hooked_model)
    handle = step_in_backward(hooked)
    for step in range(4):  # refreshes at steps 0 and 3
        x, y = _batch(step)
        _loss(plain_model, x, y).backward()
        plain.step()
        plain.zero_grad(set_to_none=False)
        _loss(hooked_model, x, y).backward()
        assert all(p.grad is None for p in hooked_model.parameters())
        assert float(torch.nn.utils.clip_grad_norm_(hooked_model.parameters(), 1.0)) == 0.0
        hooked.step()
        hooked.zero_grad(set_to_none=False)
    handle.remove()
    assert all(p.grad is not None for p in plain_model.parameters())
    for p, q in zip(plain_model.parameters(), hooked_model.parameters()):
        assert torch.equal(p, q)


def test_a_step_pre_hook_is_warned_of_as_it_runs_after_the_updates_in_the_backward_pass():
    model = _net()
    opt = _optimizer(model)
    calls = []
    opt.register_step_pre_hook(lambda *args: calls.append("pre"))
    with pytest.warns(UserWarning, match=r"1 step pre-hook\(s\); they run at optimizer.step\(\), after the updates"):
        handle = step_in_backward(opt)
    before = model.b.weight.detach().clone()
    x, y = _batch(2)
    _loss(model, x, y).backward()
    assert calls == [] and not torch.equal(model.b.weight, before)  # updated before any pre-hook ran
    opt.step()
    assert calls == ["pre"]
    handle.remove()
    with warnings.catch_warnings():  # none without a pre-hook
        warnings.simplefilter("error")
        step_in_backward(_optimizer(_net())).remove()
