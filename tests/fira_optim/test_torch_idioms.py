"""FiraAdamW behaves as torch.optim.AdamW does under torch's usual idioms, wherever Fira does not
need to differ, and refuses clearly where a state dict cannot mean what it says."""

import copy
import inspect
import pickle
import re
import warnings

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


def test_torch_adamw_state_refused_by_a_low_precision_plain_group_says_where_it_comes_from():
    """torch.optim.AdamW's groups have no state_dtype, as fira-optim's had none before the option:
    the refusal said the state dict was saved before the option existed, of a torch state."""
    model = _model()
    adamw = torch.optim.AdamW(model.parameters())
    _grads(model)
    adamw.step()
    with pytest.raises(ValueError, match=r"saved with state_dtype='float32' \(its group has no 'state_dtype': saved by "
                                         r"an optimizer without that option: torch\.optim's, .*build the optimizer "
                                         r"with state_dtype='float32'"):
        FiraAdamW(model.parameters(), rank=None, state_dtype="bfloat16").load_state_dict(adamw.state_dict())


def test_torch_adam_state_with_l2_weight_decay_is_refused_and_without_it_loads():
    """torch.optim.Adam's groups hold decoupled_weight_decay=False: its weight decay is an L2
    term of the gradient. Such a state loaded into a plain group, which then stepped with
    decoupled decay while its group said False. Without weight decay the steps are the same:
    it loads, and then steps as Adam does."""
    model, twin = _model(), _model()
    adam = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=0.1)
    _grads(model)
    adam.step()
    fira = FiraAdamW([{"params": list(twin.parameters())}], lr=0.01, weight_decay=0.1)
    before = copy.deepcopy(fira.param_groups[0])
    with pytest.raises(ValueError, match=r"decoupled_weight_decay=False with weight_decay=0.1"):
        fira.load_state_dict(copy.deepcopy(adam.state_dict()))
    assert fira.param_groups[0].keys() == before.keys()  # a refused load leaves the groups as they were

    for group in adam.param_groups:
        group["weight_decay"] = 0.0
    fira.load_state_dict(copy.deepcopy(adam.state_dict()))
    assert fira.param_groups[0]["decoupled_weight_decay"] is True  # what it does
    with torch.no_grad():
        for p, q in zip(twin.parameters(), model.parameters()):
            p.copy_(q)
    _grads(model, seed=1)
    _grads(twin, seed=1)
    adam.step()
    fira.step()
    for p, q in zip(twin.parameters(), model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_a_projected_dict_group_with_1d_params_says_how_to_split():
    model = _model()
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\].*rank=None.*param_groups\(model"):
        FiraAdamW([{"params": list(model.parameters()), "rank": 3}])


def test_a_named_parameter_a_group_cannot_take_is_named_in_the_constructor_s_error():
    """Groups of ``named_parameters()`` keep the names (``param_names``): the step's errors named
    them, the constructor's said only where the tensor sits in the groups."""
    model = _model()
    with pytest.raises(ValueError, match=r"^bias \(param_groups\[0\]\['params'\]\[1\]\) has shape"):
        FiraAdamW([{"params": list(model[0].named_parameters()), "rank": 3}])
    z = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.complex64))
    with pytest.raises(ValueError, match=r"^z \(param_groups\[0\]\['params'\]\[0\]\) is complex"):
        FiraAdamW([{"params": [("z", z)], "rank": 2}])


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


def test_a_compiled_training_step_runs_the_reference_and_matches_it():
    """torch.compile around a whole training step (backward and step): the fast strategy's fused
    kernels cannot be traced (functionalization refused torch._fused_adam_, after the step
    counts had moved); under compilation the step runs the reference, whose result it equals."""
    def train(implementation: str, compiled: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
        opt = FiraAdamW(model.parameters(), lr=1e-2, rank=4, update_proj_gap=2, implementation=implementation)

        def step(x):
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        run = torch.compile(step, backend="aot_eager") if compiled else step
        generator = torch.Generator().manual_seed(0)
        for _ in range(4):  # refreshes at steps 0 and 2: the basis is traced too
            run(torch.randn(4, 16, generator=generator))
        return [p.detach() for p in model.parameters()]

    torch._dynamo.reset()
    for compiled, eager in zip(train("fast", True), train("reference", False)):
        torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-5)


def test_adamws_own_keywords_are_accepted_at_their_defaults_and_refused_otherwise():
    model = _model()
    adamw_defaults = torch.optim.AdamW(model.parameters()).defaults
    opt = FiraAdamW(model.parameters(), rank=3, **adamw_defaults)  # a drop-in takes AdamW's own keywords
    assert opt.defaults["weight_decay"] == adamw_defaults["weight_decay"]
    _grads(model)
    opt.step()
    for key, value in [("amsgrad", True), ("maximize", True), ("capturable", True), ("differentiable", True)]:
        with pytest.raises(ValueError, match=f"Invalid {key}: True; Fira does not implement"):
            FiraAdamW(model.parameters(), **{key: value})
    with pytest.raises(ValueError, match="Invalid decoupled_weight_decay: False; Fira's weight decay is decoupled"):
        FiraAdamW(model.parameters(), decoupled_weight_decay=False)


def test_an_explicit_rank_is_the_default_of_dict_groups_without_one():
    """As torch's keywords are for groups: FiraAdamW(groups, rank=16) projects the matrices of the
    groups that set no rank (a Hugging Face Trainer's decay / no-decay groups were silently
    plain AdamW). Without rank=, a group without the key stays unprojected (the released fira)."""
    model = _model()
    weights = [p for p in model.parameters() if p.dim() == 2]
    biases = [p for p in model.parameters() if p.dim() != 2]
    def groups():  # fresh dicts: torch's add_param_group fills its defaults into the ones given
        return [{"params": weights, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0}]

    opt = FiraAdamW(groups(), rank=3)
    assert [(g["rank"], g["weight_decay"], len(g["params"])) for g in opt.param_groups] == [(3, 0.1, 2), (None, 0.0, 2)]
    mixed = FiraAdamW([{"params": list(model.parameters())}], rank=3)  # split like a flat list
    assert [(g["rank"], len(g["params"])) for g in mixed.param_groups] == [(3, 2), (None, 2)]
    # a group that sets its own rank: the groups are Fira's already, the others plain on purpose
    own = FiraAdamW([{"params": weights[:1], "rank": 2}, {"params": weights[1:] + biases}], rank=3)
    assert [(g["rank"], len(g["params"])) for g in own.param_groups] == [(2, 1), (None, 3)]
    with pytest.raises(TypeError, match="param group 0: 'params' is a set"):  # as torch refuses it, before the split
        FiraAdamW([{"params": set(weights)}], rank=3)
    released = FiraAdamW(groups())  # the default rank is not a group default, nor a copy of it
    assert [g["rank"] for g in released.param_groups] == [None, None]
    default = inspect.signature(FiraAdamW).parameters["rank"].default  # e.g. kwargs copied to a worker
    for copied in (copy.deepcopy(default), pickle.loads(pickle.dumps(default))):
        assert copied == 128 and [g["rank"] for g in FiraAdamW(groups(), rank=copied).param_groups] == [None, None]
    assert [g["rank"] for g in FiraAdamW(groups(), rank=128).param_groups] == [128, None]  # given, though the default
    assert [g["rank"] for g in FiraAdamW(model.parameters()).param_groups] == [128, None]


def test_dict_groups_none_of_which_sets_a_rank_warn_that_nothing_is_projected():
    """Without rank=, dict groups are projected only with a rank of their own (the released fira):
    torch's decay / no-decay groups, a Hugging Face Trainer's through optimizer_cls_and_kwargs,
    trained as plain AdamW without a word, though the signature says rank=128. Warned of where
    they hold a matrix; rank=None (plain AdamW meant), a group with its own rank, or groups
    without a matrix are not."""
    model = _model()
    weights = [p for p in model.parameters() if p.dim() == 2]
    biases = [p for p in model.parameters() if p.dim() != 2]

    def groups():
        return [{"params": weights, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0}]

    with pytest.warns(UserWarning, match=r"none of the 2 param groups sets 'rank', and rank= was not passed: .*"
                                         r"nothing is projected and the optimizer is plain AdamW"):
        opt = FiraAdamW(groups())
    assert [g["rank"] for g in opt.param_groups] == [None, None]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [g["rank"] for g in FiraAdamW(groups(), rank=None).param_groups] == [None, None]
        FiraAdamW([{"params": weights, "rank": 3}, {"params": biases}])
        FiraAdamW([{"params": biases}])


@pytest.mark.parametrize(("base", "plain"), [("adagrad", "Adagrad"), ("rmsprop", "RMSprop")])
def test_the_warning_of_groups_without_a_rank_names_the_base_optimizer_they_step_with(base, plain):
    """Unprojected groups step with the base optimizer (torch's Adagrad / RMSprop with decoupled
    weight decay): the warning said "plain AdamW" of an optimizer built with base='adagrad'."""
    weights = [p for p in _model().parameters() if p.dim() == 2]
    with pytest.warns(UserWarning, match=rf"nothing is projected and the optimizer is plain {plain}\b") as caught:
        FiraAdamW([{"params": weights}], base=base)
    assert not any("AdamW" in str(w.message).split("rank= was not passed")[1] for w in caught)


@pytest.mark.parametrize(("options", "message"), [
    ({"lr": "0.1"}, "Invalid lr: '0.1'; expected a number"),  # a string from a config file
    ({"eps": None}, "Invalid eps: None"),
    ({"betas": "ab"}, "Invalid betas: 'ab'; expected a pair of numbers"),
    ({"betas": (0.9, "0.99")}, "Invalid betas: '0.99'"),
    ({"gamma": [1.01]}, "Invalid gamma: [1.01]"),
    # infinite: NaN updates (the limiter's inf / inf, inf * 0) or none (eps); torch lets them through
    ({"gamma": float("inf")}, "Invalid gamma: inf; expected a finite number (the variant fira-no-limiter"),
    ({"alpha": float("inf")}, "Invalid alpha: inf; expected a finite number"),
    ({"eps": float("inf")}, "Invalid eps: inf; expected a finite number"),
    ({"weight_decay": float("inf")}, "Invalid weight_decay: inf; expected a finite number"),
    ({"lr": torch.tensor(float("inf"))}, "Invalid lr: inf; expected a finite number"),
    # finite, but no fp32 update can be scaled by it (torch raised an overflow from inside the step)
    ({"lr": 1e308}, "Invalid lr: 1e+308; expected at most 3.403e+38, float32's largest"),
    ({"alpha": 1e39}, "Invalid alpha: 1e+39; expected at most 3.403e+38"),
])
def test_a_hyperparameter_that_is_not_a_finite_number_is_named(options: dict, message: str):
    with pytest.raises(ValueError, match=re.escape(message)):
        FiraAdamW(_model().parameters(), rank=3, **options)
