"""FiraAdamW behaves as torch.optim.AdamW does under torch's usual idioms, wherever Fira does not
need to differ, and refuses clearly where a state dict cannot mean what it says."""

import copy

import pytest
import torch

from fira_optim import FiraAdamW



def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 20), torch.nn.ReLU(), torch.nn.Linear(20, 12))


def _grads(model, seed=0):
    x = torch.randn(6, 12, generator=torch.Generator().manual_seed(seed))
    model.zero_grad()
    model(x).square().mean().backward()


def test_named_parameters_are_accepted_and_named_in_the_state_dict():
    model, twin = _model(), _model()
    named = FiraAdamW(model.named_parameters(), rank=3, update_proj_gap=2)
    plain = FiraAdamW(twin.parameters(), rank=3, update_proj_gap=2)
    for seed in range(3):
        for m, opt in ((model, named), (twin, plain)):
            _grads(m, seed)
            opt.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
    names = [n for g in named.state_dict()["param_groups"] for n in g["param_names"]]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    projected = next(g for g in named.param_groups if g["rank"] is not None)
    assert all(model.get_parameter(n).dim() == 2 for n in projected["param_names"])


def test_a_loaded_state_dict_round_trips_unchanged():
    model = _model()
    a = FiraAdamW(model.parameters(), rank=3)
    _grads(model)
    a.step()
    b = FiraAdamW(model.parameters(), rank=3)
    saved = a.state_dict()
    b.load_state_dict(copy.deepcopy(saved))
    again = b.state_dict()
    assert [sorted(g) for g in again["param_groups"]] == [sorted(g) for g in saved["param_groups"]]
    assert again["param_groups"] == saved["param_groups"]


def test_a_plain_number_step_from_an_older_checkpoint_loads_and_steps():
    model = _model()
    opt = FiraAdamW(model.parameters(), rank=3, update_proj_gap=2)
    for seed in range(2):
        _grads(model, seed)
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    for state in saved["state"].values():
        state["step"] = int(state["step"])  # as torch < 1.12 and many trainers saved it
    reference = copy.deepcopy(model)
    ref_opt = FiraAdamW(reference.parameters(), rank=3, update_proj_gap=2)
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    opt.load_state_dict(saved)
    for m, o in ((model, opt), (reference, ref_opt)):
        _grads(m, 5)
        o.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)
    assert all(isinstance(s["step"], torch.Tensor) for s in opt.state.values())


@pytest.mark.parametrize("lr", [torch.tensor(1e-2), torch.tensor([1e-2])], ids=["0-d", "1-d"])
def test_a_one_element_tensor_lr_equals_the_float(lr):
    runs = []
    for value in (lr, 1e-2):
        model = _model()
        opt = FiraAdamW(model.parameters(), lr=value, rank=3, update_proj_gap=2)
        for seed in range(3):
            _grads(model, seed)
            opt.step()
        runs.append(list(model.parameters()))
    for p, q in zip(*runs):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_tensor_lr_errors_are_torchs_and_come_at_construction():
    params = list(_model().parameters())
    with pytest.raises(ValueError, match="Tensor lr must be 1-element"):
        FiraAdamW(params, lr=torch.tensor([1e-3, 1e-3]))
    with pytest.raises(ValueError, match="lr as a Tensor is not supported for capturable=False and foreach=True"):
        FiraAdamW(params, lr=torch.tensor(1e-3), foreach=True)


def test_fp16_params_keep_fp32_moments_and_stay_finite():
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(12, 20).half())
    bias = torch.nn.Parameter(torch.zeros(20).half())
    opt = FiraAdamW([{"params": [weight], "rank": 3}, {"params": [bias]}], lr=1e-3)
    weight.grad = (torch.randn(12, 20) * 300).half()
    # Zero and small entries: in fp16, eps = 1e-8 and (1 - beta2) g^2 round to 0, so fp16
    # moments give 0 / 0 where the gradient is zero.
    bias.grad = torch.cat([torch.zeros(10), torch.full((10,), 1e-3)]).half()
    opt.step()
    assert torch.isfinite(bias).all() and torch.isfinite(weight).all()
    assert bias.dtype == weight.dtype == torch.float16
    for p in (weight, bias):
        for key in ("exp_avg", "exp_avg_sq"):
            assert opt.state[p][key].dtype == torch.float32
    saved = copy.deepcopy(opt.state_dict())
    again = FiraAdamW([{"params": [weight], "rank": 3}, {"params": [bias]}], lr=1e-3)
    again.load_state_dict(saved)
    assert again.state[bias]["exp_avg_sq"].dtype == torch.float32


def test_loading_a_state_dict_of_another_rank_is_refused():
    model = _model()
    opt = FiraAdamW(model.parameters(), rank=3)
    _grads(model)
    opt.step()
    other = FiraAdamW(model.parameters(), rank=2)
    with pytest.raises(ValueError, match=r"rank=3.*rank=2|rank=2.*rank=3"):
        other.load_state_dict(opt.state_dict())


def test_loading_torch_adamw_state_is_refused():
    model = _model()
    adamw = torch.optim.AdamW(model.parameters())
    _grads(model)
    adamw.step()
    with pytest.raises(ValueError, match="torch.optim.AdamW|not saved by Fira"):
        FiraAdamW(model.parameters(), rank=3).load_state_dict(adamw.state_dict())


def test_a_projected_dict_group_with_1d_params_says_how_to_split():
    model = _model()
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\].*rank=None.*param_groups\(model"):
        FiraAdamW([{"params": list(model.parameters()), "rank": 3}])


@pytest.mark.parametrize(("group", "error"), [
    ({"lr": -1.0}, "Invalid learning rate"),
    ({"rank": 2, "extra_1d": True}, "has shape"),
])
def test_a_refused_param_group_is_not_kept(group: dict, error: str):
    """torch's add_param_group appends before Fira's checks ran: the refused group stayed and
    step() trained it as given (lr=-1: gradient ascent); a corrected retry found its tensors
    'in more than one parameter group'."""
    model = _model()
    opt = FiraAdamW(model.parameters(), rank=3)
    count = len(opt.param_groups)
    extra = [torch.nn.Parameter(torch.randn(6, 5))]
    if group.pop("extra_1d", False):
        extra.append(torch.nn.Parameter(torch.randn(5)))
    with pytest.raises(ValueError, match=error):
        opt.add_param_group({"params": extra, **group})
    assert len(opt.param_groups) == count
    opt.add_param_group({"params": extra[:1]})  # the corrected retry
    assert len(opt.param_groups) == count + 1
    with pytest.raises(TypeError, match="param_group must be a dict, but got torch.FloatTensor"):
        opt.add_param_group(torch.zeros(2))


def test_a_parameter_replaced_in_its_group_is_the_one_stepped():
    """As with torch.optim.AdamW: the group's list says which tensors are stepped (the layout
    cache was keyed on the list's identity and length, and kept stepping the old tensor)."""
    model = _model()
    opt = FiraAdamW(model.parameters(), rank=3)
    _grads(model)
    opt.step()
    group = next(g for g in opt.param_groups if g["rank"] is None)
    old = group["params"][0]
    new = torch.nn.Parameter(old.detach().clone())
    group["params"][0] = new
    opt.state[new] = opt.state.pop(old)
    new.grad = torch.ones_like(new)
    old.grad = torch.ones_like(old)
    before_old, before_new = old.detach().clone(), new.detach().clone()
    opt.step()
    assert torch.equal(old, before_old) and not torch.equal(new, before_new)
