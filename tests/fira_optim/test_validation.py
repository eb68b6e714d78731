"""Bad input at construction (RELIABILITY.md section E): every error names the argument and the
value, for constructor arguments and for the same options given per param group."""

import copy
import pickle
import warnings

import pytest
import torch

from fira_optim import FiraAdamW, GaLoreAdamW

from .common import make_params


def _params():
    return make_params([(12, 20), (7,)])


def test_bare_tensor_is_a_type_error():
    with pytest.raises(TypeError, match="iterable of Tensors or dicts"):
        FiraAdamW(torch.nn.Parameter(torch.randn(4, 4)))


@pytest.mark.parametrize("params", [
    lambda: torch.nn.Sequential(torch.nn.Linear(3, 4)),  # iterates over its modules
    lambda: [1.0],
    lambda: [{"params": [torch.nn.Linear(3, 4)]}],  # a dict group split with the explicit rank below
])
def test_params_that_are_not_tensors_get_torchs_type_error(params):
    # as torch.optim.AdamW words it, not an AttributeError from the split into matrices and the rest
    with pytest.raises(TypeError, match="can only optimize Tensors"):
        FiraAdamW(params(), rank=2)


@pytest.mark.parametrize("params", [[], iter([])])
def test_empty_params_raise(params):
    with pytest.raises(ValueError, match="empty parameter list"):
        FiraAdamW(params)


def test_tensors_and_dicts_mixed_is_a_type_error():
    a, b = _params()
    with pytest.raises(TypeError, match="all tensors or all dicts"):
        FiraAdamW([a, {"params": [b]}])


def test_same_param_in_two_groups_raises():
    # Tied embeddings: one tensor reachable as the input embedding and the output head.
    a, b = _params()
    with pytest.raises(ValueError, match="more than one parameter group"):
        FiraAdamW([{"params": [a], "rank": 3}, {"params": [b, a]}])


# (argument, bad value): the message must contain both.
BAD_VALUES = [
    ("lr", -1e-3),
    ("eps", -1e-8),
    ("betas", (1.0, 0.999)),
    ("betas", (0.9, 1.0)),
    ("betas", (-0.1, 0.999)),
    ("betas", (0.9,)),
    ("weight_decay", -0.1),
    ("rank", 0),
    ("rank", -4),
    ("rank", 2.5),
    ("update_proj_gap", 0),
    ("update_proj_gap", 1.5),
    ("alpha", 0.0),
    ("alpha", -0.25),
    ("gamma", 0.99),
    ("clip_norm", 0.0),
    ("mu", 0.0),
    ("mu", 1.5),
    ("proj_type", "full"),
    ("projector", "power"),
    ("arithmetic", "torch"),
    ("base", "sgd"),
    ("scaling", "row"),
    ("limiter", "max"),
    ("residual", "keep"),
    ("foreach", "yes"),
    ("fused", 1),
    ("seed", None),
    ("seed", 1.5),
    ("correct_bias", "False"),  # a string from a config file: truthy, would keep bias correction on
    ("stagger", "yes"),
    ("only_scaling", 1),
]


def _assert_names(err, name, value):
    message = str(err.value)
    assert name in message, message
    assert str(value) in message, message


@pytest.mark.parametrize("name,value", BAD_VALUES, ids=[f"{n}={v}" for n, v in BAD_VALUES])
def test_bad_constructor_argument_names_argument_and_value(name, value):
    a, b = _params()
    with pytest.raises(ValueError) as err:
        FiraAdamW([a, b], **{name: value})
    _assert_names(err, name, value)


@pytest.mark.parametrize("name,value", BAD_VALUES, ids=[f"{n}={v}" for n, v in BAD_VALUES])
def test_bad_group_option_names_argument_and_value(name, value):
    a, b = _params()
    group = {"params": [a], "rank": 3, name: value}
    with pytest.raises(ValueError) as err:
        FiraAdamW([group, {"params": [b]}])
    _assert_names(err, name, value)
    # The same through add_param_group, after construction.
    opt = FiraAdamW([{"params": [b]}])
    with pytest.raises(ValueError) as err:
        opt.add_param_group({"params": [a], "rank": 3, name: value})
    _assert_names(err, name, value)


@pytest.mark.parametrize("name,value", [("nonfinite", "warn"), ("implementation", "cuda")])
def test_bad_instance_option_names_argument_and_value(name, value):
    with pytest.raises(ValueError) as err:
        FiraAdamW(_params(), **{name: value})
    _assert_names(err, name, value)


def test_galore_validates_too():
    with pytest.raises(ValueError) as err:
        GaLoreAdamW(_params(), lr=-1.0)
    _assert_names(err, "lr", -1.0)


def test_released_arithmetic_needs_the_adam_base():
    with pytest.raises(ValueError, match="arithmetic='released'.*base='adagrad'"):
        FiraAdamW(_params(), arithmetic="released", base="adagrad")


def test_uncorrected_bias_only_with_released_arithmetic():
    with pytest.raises(ValueError, match="correct_bias=False"):
        FiraAdamW(_params(), correct_bias=False)
    FiraAdamW(_params(), correct_bias=False, arithmetic="released")  # the released option


def test_valid_edge_values_are_accepted():
    # The closed ends of each range are legal.
    FiraAdamW(_params(), lr=0.0, eps=0.0, betas=(0.0, 0.0), weight_decay=0.0, rank=1,
              update_proj_gap=1, gamma=1.0, mu=1.0)


def test_fused_needs_torch_adamw_and_excludes_foreach():
    a, b = _params()
    with pytest.raises(ValueError, match="cannot be set together"):
        FiraAdamW([a, b], foreach=True, fused=True)
    with pytest.raises(ValueError, match="base='adagrad'"):
        FiraAdamW([a, b], fused=True, base="adagrad")
    with pytest.raises(ValueError, match="arithmetic='released'"):
        FiraAdamW([a, b], fused=True, arithmetic="released")


@pytest.mark.parametrize("name", ["maximize", "amsgrad", "capturable", "differentiable"])
def test_torch_adamw_options_fira_lacks_are_refused_when_on(name):
    # torch.optim.AdamW's keywords: in a group they would otherwise be ignored silently
    # (a maximize=True group minimized).
    a, b = _params()
    with pytest.raises(ValueError) as err:
        FiraAdamW([{"params": [a], "rank": 3, name: True}, {"params": [b]}])
    _assert_names(err, name, True)
    FiraAdamW([{"params": [a], "rank": 3, name: False}, {"params": [b]}])  # off is what Fira does


@pytest.mark.parametrize("name,value", [("maximize", True), ("amsgrad", True), ("capturable", True),
                                        ("differentiable", True), ("decoupled_weight_decay", False)])
def test_torch_adamw_options_fira_lacks_set_in_param_groups_later_are_refused_at_the_step(name, value):
    """torch.optim.AdamW reads them from its groups at every step; set in ``param_groups`` after the
    constructor (``group["maximize"] = True``), Fira stepped on without them (a maximize group
    minimized). Refused before anything changes; set back, the optimizer trains on."""
    a, b = _params()
    opt = FiraAdamW([{"params": [a], "rank": 3}, {"params": [b]}], weight_decay=0.1)
    for p in (a, b):
        p.grad = torch.ones_like(p)
    opt.step()
    before = [a.detach().clone(), b.detach().clone()]
    opt.param_groups[1][name] = value
    with pytest.raises(ValueError, match=rf"param_groups\[1\]: Invalid {name}: {value}"):
        opt.step()
    assert torch.equal(a, before[0]) and torch.equal(b, before[1])
    opt.param_groups[1][name] = not value
    opt.step()
    assert [float(opt.state[p]["step"]) for p in (a, b)] == [2.0, 2.0]


def test_the_capturable_flag_torch_compile_shows_in_every_group_is_not_refused_while_tracing():
    """Dynamo's view of an optimizer's ``param_groups`` reads ``capturable=True`` in every group,
    whatever the group holds: the step's check refused that flag, which the caller never set, so a
    compiled step broke its trace there (``fullgraph=True`` failed with "Invalid capturable: True").
    The other options are still checked under compilation."""
    from fira_optim.options import check_torch_only

    a, b = _params()
    opt = FiraAdamW([{"params": [a], "rank": 3}, {"params": [b]}])

    def checks():
        for group in opt.param_groups:
            check_torch_only(group)

    torch._dynamo.reset()
    torch.compile(checks, backend="eager", fullgraph=True)()
    opt.param_groups[1]["maximize"] = True
    torch._dynamo.reset()
    with pytest.raises(ValueError, match=r"Invalid maximize: True"):
        torch.compile(checks, backend="eager")()


@pytest.mark.parametrize("name,value", [("split_refresh", True), ("implementation", "reference"),
                                        ("nonfinite", "skip"), ("host_refresh", True)])
def test_optimizer_wide_options_in_a_group_are_refused(name, value):
    a, b = _params()
    with pytest.raises(ValueError, match=f"{name}=.*pass it to the constructor"):
        FiraAdamW([{"params": [a], "rank": 3, name: value}, {"params": [b]}])


def test_split_refresh_must_be_a_bool():
    with pytest.raises(ValueError) as err:
        FiraAdamW(_params(), split_refresh="yes")
    _assert_names(err, "split_refresh", "yes")


def test_integer_options_take_numpy_and_tensor_integers():
    np = pytest.importorskip("numpy")
    a, b = _params()
    opt = FiraAdamW([a, b], rank=np.int64(3), update_proj_gap=np.int32(2), seed=torch.tensor(5))
    group = opt.param_groups[0]
    assert (group["rank"], group["update_proj_gap"], group["seed"]) == (3, 2, 5)
    assert all(type(group[k]) is int for k in ("rank", "update_proj_gap", "seed"))
    opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(6, 8))], "rank": np.int64(2)})
    assert type(opt.param_groups[-1]["rank"]) is int


def test_numpy_float_options_are_kept_as_python_floats_so_the_state_dict_loads_weights_only():
    """A NumPy float (np.float32(1e-3), a sweep's np.logspace value) was kept in the group as
    given: the state dict then held a NumPy scalar, which torch.load(weights_only=True) (the
    Hugging Face Trainer's resume) refuses. The value is kept, as a Python float."""
    import io

    np = pytest.importorskip("numpy")
    a, b = _params()
    opt = FiraAdamW([a, b], rank=3, lr=np.float32(1e-3), betas=(np.float64(0.9), 0.999), eps=np.float64(1e-8),
                    weight_decay=np.float32(0.1), alpha=np.float32(0.5), gamma=np.float64(1.01))
    opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(6, 8))], "rank": 2, "lr": np.float64(0.01)})
    for group in opt.param_groups:
        for key in ("lr", "eps", "weight_decay", "alpha", "gamma"):
            assert type(group[key]) is float, (key, type(group[key]))
        assert [type(beta) for beta in group["betas"]] == [float, float]
    assert opt.param_groups[0]["lr"] == float(np.float32(1e-3)) and opt.param_groups[0]["betas"] == (0.9, 0.999)
    tensor_lr = FiraAdamW([a], rank=3, lr=torch.tensor(1e-3))  # tensors stay tensors
    assert isinstance(tensor_lr.param_groups[0]["lr"], torch.Tensor)
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    torch.load(buffer, weights_only=True)


def test_a_projected_group_with_nothing_to_project_warns() -> None:
    wide, narrow = torch.nn.Parameter(torch.randn(16, 8)), torch.nn.Parameter(torch.randn(8, 4))
    with pytest.warns(UserWarning, match=r"param_groups\[0\]: rank=8 is >= min\(m, n\) of each of its 2 "
                                         r"matrices \(the largest min\(m, n\) is 8\): none is projected") as caught:
        FiraAdamW([{"params": [wide, narrow], "rank": 8}])
    assert caught[0].filename == __file__  # the user's line, not torch.optim's
    optimizer = FiraAdamW([{"params": [wide], "rank": 4}])
    with pytest.warns(UserWarning, match=r"param_groups\[1\]: rank=4 is >= min\(m, n\) of its matrix") as caught:
        optimizer.add_param_group({"params": [narrow], "rank": 4})
    assert caught[0].filename == __file__
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FiraAdamW([{"params": [wide, narrow], "rank": 4}])  # wide is projected: no warning
        FiraAdamW([{"params": [narrow], "rank": None}])  # not a projected group


def test_a_rank_changed_in_param_groups_during_training_is_refused_before_anything_changes() -> None:
    """It used to fail midway through a step: one matrix updated, another's step counted, a
    third untouched; a rank moved to 5 was ignored until the next refresh."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in ((8, 12), (12, 8), (20, 30))]
    opt = FiraAdamW([{"params": params, "rank": 3}], update_proj_gap=3)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.param_groups[0]["rank"] = 0  # before any state: checked as the constructor checks it
    with pytest.raises(ValueError, match="Invalid rank: 0"):
        opt.step()
    opt.param_groups[0]["rank"] = 3
    opt.step()
    before = [p.detach().clone() for p in params]
    for rank in (8, 5):
        opt.param_groups[0]["rank"] = rank
        with pytest.raises(ValueError, match=rf"param_groups\[0\]\['rank'\] changed from 3 to {rank} after"):
            opt.step()
        assert all(torch.equal(p, b) for p, b in zip(params, before))
        assert [float(opt.state[p]["step"]) for p in params] == [1.0] * 3
    opt.param_groups[0]["rank"] = 3  # set back: trains on
    opt.step()
    assert [float(opt.state[p]["step"]) for p in params] == [2.0] * 3
    # a group added at the same time does not hide the change
    extra = torch.nn.Parameter(torch.zeros(4))
    opt.add_param_group({"params": [extra], "rank": None})
    opt.param_groups[0]["rank"] = 5
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['rank'\] changed from 3 to 5 after"):
        opt.step()


def test_a_state_dtype_set_in_param_groups_after_states_exist_is_refused_before_anything_changes() -> None:
    """Back to float32 it failed inside torch after the weight decay; to int8 it kept fp32 states
    without a word."""
    pytest.importorskip("torchao")
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in ((64, 256), (4096,))]
    for first, then in (("int8", "float32"), ("bfloat16", "float32"), ("float32", "int8")):
        opt = FiraAdamW([{"params": params[:1], "rank": 4}, {"params": params[1:]}], state_dtype=first,
                        weight_decay=0.1)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
        _refused_then_set_back(opt, params, "state_dtype", first, then)


@pytest.mark.parametrize(("key", "first", "then"), [("proj_type", "std", "left"), ("base", "adam", "adagrad"),
                                                    ("residual", "drop", "add")])
def test_a_side_base_or_residual_rule_set_after_states_exist_is_refused_before_anything_changes(key, first,
                                                                                               then) -> None:
    """They looked for states the old rule does not keep (KeyError, a shape error), after the step
    counters (or a plain parameter's weight decay) had moved: a step set back then drifted."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in ((8, 12), (12, 8), (6,))]
    opt = FiraAdamW([{"params": params[:2], "rank": 3, key: first}, {"params": params[2:], "rank": None, key: first}],
                    weight_decay=0.1)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    _refused_then_set_back(opt, params, key, first, then)


@pytest.mark.filterwarnings("ignore:.*none is projected:UserWarning")  # rank 8 >= 6 without only_scaling
@pytest.mark.parametrize("first", [False, True])
def test_only_scaling_set_after_states_exist_is_refused_where_it_changes_what_is_projected(first) -> None:
    """Fira-only-scaling projects a matrix of rank >= min(m, n), which the others train whole: set
    in param_groups during training, the step went on with the cached layout (plain Adam under
    only_scaling, or a projection without it), and only a copy, a pickle or a load found the states
    did not fit, blaming the unchanged rank. Where it changes nothing (rank < min(m, n)) it stands."""
    gen = torch.Generator().manual_seed(0)
    whole, low = torch.nn.Parameter(torch.randn(6, 8, generator=gen)), torch.nn.Parameter(torch.randn(12, 10, generator=gen))
    opt = FiraAdamW([{"params": [whole], "rank": 8}, {"params": [low], "rank": 3}], only_scaling=first)
    for p in (whole, low):
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    assert ("basis" in opt.state[whole]) is first
    opt.param_groups[1]["only_scaling"] = not first  # rank 3 < 10: the same states
    opt.step()
    assert float(opt.state[low]["step"]) == 2.0
    before = [p.detach().clone() for p in (whole, low)]
    opt.param_groups[0]["only_scaling"] = not first
    what = "has no projection basis" if not first else "holds a projection basis"
    for stepping in (opt, copy.deepcopy(opt)):
        with pytest.raises(ValueError, match=rf"param_groups\[0\]\['params'\]\[0\] \(shape \(6, 8\)\) {what}.*"
                                             rf"rank=8 with(out)? only_scaling"):
            stepping.step()
    assert torch.equal(whole, before[0]) and torch.equal(low, before[1])
    assert float(opt.state[whole]["step"]) == 2.0
    opt.param_groups[0]["only_scaling"] = first  # set back: trains on
    opt.step()
    assert float(opt.state[whole]["step"]) == 3.0


@pytest.mark.filterwarnings("ignore:.*none is projected:UserWarning")  # rank 8 >= 6 without only_scaling
def test_an_only_scaling_state_saved_before_it_projected_at_full_rank_is_refused_naming_it() -> None:
    """fira-optim trained a matrix of rank >= min(m, n) whole under only_scaling before it
    projected it: such a state dict is refused by name, and the optimizer is left as it was."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(6, 8, generator=gen))
    older = FiraAdamW([{"params": [weight], "rank": 8}])  # the layout of an older only_scaling run
    weight.grad = torch.randn(6, 8, generator=gen)
    older.step()
    saved = older.state_dict()
    saved["param_groups"][0]["only_scaling"] = True
    opt = FiraAdamW([{"params": [weight], "rank": 8}], only_scaling=True)
    opt.step()
    with pytest.raises(ValueError, match=r"has no projection basis.*rank=8 with only_scaling=True, which projects"):
        opt.load_state_dict(saved)
    assert "basis" in opt.state[weight] and opt.param_groups[0]["only_scaling"] is True


def _refused_then_set_back(opt, params, key: str, first: str, then: str) -> None:
    """After one step: ``key`` set to ``then`` in every group is refused with nothing changed,
    and set back to ``first`` the optimizer trains on."""
    before = [p.detach().clone() for p in params]
    for group in opt.param_groups:
        group[key] = then
    with pytest.raises(ValueError, match=rf"param_groups\[0\]\['{key}'\] changed from '{first}' to '{then}' after"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert [float(opt.state[p]["step"]) for p in params] == [1.0] * len(params)
    for group in opt.param_groups:
        group[key] = first
    opt.step()  # set back: trains on, as if never changed
    assert [float(opt.state[p]["step"]) for p in params] == [2.0] * len(params)


def test_a_loaded_state_dict_with_an_option_fira_lacks_or_a_plain_state_of_another_shape_is_refused() -> None:
    """amsgrad / maximize of a torch.optim.AdamW state were dropped without a word (a maximize
    run then descended); a plain state of another shape loaded, and the next step failed midway."""
    weight, bias = torch.nn.Parameter(torch.randn(8, 12)), torch.nn.Parameter(torch.randn(7))
    for key in ("maximize", "amsgrad"):
        adamw = torch.optim.AdamW([bias], **{key: True})
        bias.grad = torch.ones(7)
        adamw.step()
        fira = FiraAdamW([{"params": [bias], "rank": None}])
        with pytest.raises(ValueError, match=rf"param group 0 has {key}=True, which Fira does not implement"):
            fira.load_state_dict(adamw.state_dict())
    other = torch.nn.Parameter(torch.randn(6))
    saved = FiraAdamW([{"params": [weight], "rank": 3}, {"params": [other], "rank": None}])
    weight.grad, other.grad = torch.randn(8, 12), torch.randn(6)
    saved.step()
    fira = FiraAdamW([{"params": [weight], "rank": 3}, {"params": [bias], "rank": None}])
    with pytest.raises(ValueError, match=r"loaded state 'exp_avg' of param_groups\[1\]\['params'\]\[0\] has shape "
                                         r"\(6,\), expected the parameter's \(7,\)"):
        fira.load_state_dict(saved.state_dict())


def test_a_refused_load_leaves_the_optimizer_as_it_was() -> None:
    """torch had already replaced the states and groups when the loaded shapes were checked: a
    caller that caught the error trained on a half-loaded optimizer (another parameter's states,
    the saved learning rate)."""
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.nn.Parameter(torch.randn(8, 12, generator=gen)), torch.nn.Parameter(torch.randn(7, generator=gen))
    opt = FiraAdamW([{"params": [weight], "rank": 3}, {"params": [bias], "rank": None}], lr=1e-3)
    weight.grad, bias.grad = torch.randn(8, 12, generator=gen), torch.randn(7, generator=gen)
    opt.step()
    kept = copy.deepcopy(opt.state_dict())
    state, groups = opt.state, opt.param_groups
    other = torch.nn.Parameter(torch.randn(6))
    saved = FiraAdamW([{"params": [torch.nn.Parameter(torch.randn(8, 12))], "rank": 3}, {"params": [other], "rank": None}],
                      lr=0.5)
    other.grad = torch.randn(6)
    saved.step()
    with pytest.raises(ValueError, match="expected the parameter's"):
        opt.load_state_dict(saved.state_dict())
    assert opt.state is state and opt.param_groups is groups
    after = opt.state_dict()
    assert [g["lr"] for g in after["param_groups"]] == [1e-3, 1e-3]
    assert after["state"].keys() == kept["state"].keys()
    for index, entry in kept["state"].items():
        assert all(torch.equal(value, after["state"][index][key]) for key, value in entry.items())
    opt.step()  # trains on as before
    assert [float(opt.state[p]["step"]) for p in (weight, bias)] == [2.0, 2.0]


def test_states_that_do_not_fit_their_group_are_refused_where_no_record_of_the_options_is_left() -> None:
    """Groups removed from param_groups cannot be paired with the record by place: the removal
    alone was refused ("changed from 3 to None"), and a rank set on a remaining group stepped on
    its states of the old rank; a rank of another type (3.0, equal to 3) stepped on unchecked and
    failed in the next refresh; a state_dtype set, then taken through a state dict, kept float32
    moments under an int8 group. The states themselves are checked against their groups now."""
    gen = torch.Generator().manual_seed(0)
    a, b, c = (torch.nn.Parameter(torch.randn(8, 12, generator=gen)) for _ in range(3))

    def stepped(groups):
        opt = FiraAdamW(groups)
        for group in opt.param_groups:
            for p in group["params"]:
                p.grad = torch.randn(8, 12, generator=gen)
        opt.step()
        return opt

    opt = stepped([{"params": [a], "rank": 3}, {"params": [b], "rank": 5}])
    del opt.param_groups[0]
    opt.param_groups[0]["rank"] = 3  # b's states are rank 5
    with pytest.raises(ValueError, match=r"state 'basis' of param_groups\[0\]\['params'\]\[0\] \(shape \(8, 12\)\) has "
                                         r"shape \(8, 5\), expected \(8, 3\) for rank=3"):
        opt.step()
    opt.param_groups[0]["rank"] = 5.0  # equal to 5, of another type: checked as the constructor checks it
    with pytest.raises(ValueError, match=r"param_groups\[0\]: Invalid rank: 5.0"):
        opt.step()
    opt.param_groups[0]["rank"] = 5  # a group removed: trains on
    opt.step()
    assert float(opt.state[b]["step"]) == 2.0

    opt = stepped([{"params": [a], "rank": 3}, {"params": [c], "rank": None}])
    del opt.param_groups[0]
    opt.param_groups[0]["rank"] = 3  # c was trained unprojected
    with pytest.raises(ValueError, match=r"state of param_groups\[0\]\['params'\]\[0\] \(shape \(8, 12\)\) has no "
                                         r"projection basis"):
        opt.step()
    opt.param_groups[0]["rank"] = None
    opt.step()
    assert float(opt.state[c]["step"]) == 2.0


def test_a_state_dtype_set_then_taken_through_a_state_dict_is_refused() -> None:
    pytest.importorskip("torchao")
    gen = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(64, 256, generator=gen))
    opt = FiraAdamW([{"params": [weight], "rank": 16}])
    weight.grad = torch.randn(64, 256, generator=gen)
    opt.step()
    opt.param_groups[0]["state_dtype"] = "int8"
    with pytest.raises(ValueError, match=r"loaded state 'exp_avg' of param_groups\[0\]\['params'\]\[0\] is "
                                         r"torch.float32, where state_dtype='int8' keeps torch.uint8"):
        opt.load_state_dict(opt.state_dict())
    opt.param_groups[0]["state_dtype"] = "float32"  # nothing was loaded: trains on
    opt.step()
    assert float(opt.state[weight]["step"]) == 2.0


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "load"])
def test_an_option_changed_after_a_copy_or_a_load_is_refused_as_on_the_original(how: str) -> None:
    """The refusal compared against a cache that a copy, a pickle and a load dropped: a rank set
    right after one of them was not caught, and the copy stepped at the old rank."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in ((8, 12), (12, 8))]
    opt = FiraAdamW([{"params": params, "rank": 3}])
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    if how == "load":
        other = FiraAdamW([{"params": params, "rank": 3}])
        other.load_state_dict(opt.state_dict())
    else:
        other = copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))
    mine = [p for g in other.param_groups for p in g["params"]]
    for p in mine:
        p.grad = torch.randn(p.shape, generator=gen)
    other.param_groups[0]["rank"] = 5
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['rank'\] changed from 3 to 5 after"):
        other.step()
    other.param_groups[0]["rank"] = 3
    other.step()
    assert [float(other.state[p]["step"]) for p in mine] == [2.0, 2.0]


def test_integer_parameters_with_a_gradient_are_refused_and_stochastic_rounding_of_fp16_warns() -> None:
    """A projected int matrix was "trained" by truncating the update; a frozen one (a quantized
    layer's int8 weight, as torch.optim.AdamW takes) is left alone."""
    weight, codes = torch.nn.Parameter(torch.ones(8, 8)), torch.zeros(8, 8, dtype=torch.int64)
    opt = FiraAdamW([{"params": [weight, codes], "rank": 2}])
    weight.grad = torch.ones(8, 8)
    opt.step()  # no gradient for the codes: nothing to do with them
    before = weight.detach().clone()
    codes.grad = torch.ones(8, 8, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\] \(shape \(8, 8\)\) has dtype "
                                         r"torch.int64 and a gradient"):
        opt.step()
    assert torch.equal(weight, before) and torch.equal(codes, torch.zeros(8, 8, dtype=torch.int64))
    with pytest.warns(UserWarning, match=r"param_groups\[0\] holds 2 float16 parameters \(the first: \['params'\]"
                                         r"\[1\]\): stochastic_rounding applies to bfloat16"):
        FiraAdamW([torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16)),
                   *[torch.nn.Parameter(torch.zeros(4, dtype=torch.float16)) for _ in range(2)]],
                  stochastic_rounding=True)


def test_stochastic_rounding_of_a_group_without_bf16_parameters_is_warned_of() -> None:
    """fp32 weights take the update exactly: stochastic_rounding=True changed nothing, silently."""
    with pytest.warns(UserWarning, match=r"param_groups\[0\] holds no bfloat16 parameter \(float32 only\): "
                                         r"stochastic_rounding rounds the updates of bfloat16 weights"):
        FiraAdamW([torch.nn.Parameter(torch.zeros(4, 4))], stochastic_rounding=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one bf16 parameter in the group: it applies there
        FiraAdamW([torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))],
                  stochastic_rounding=True)
        FiraAdamW([torch.nn.Parameter(torch.zeros(4))])  # off: no word


def test_a_loaded_state_dict_does_not_repeat_the_stochastic_rounding_warning() -> None:
    """load_state_dict makes new group dicts: the constructor's warning of fp32 (or fp16) weights
    under stochastic_rounding was given again at the first step of every resume."""
    params = [torch.nn.Parameter(torch.zeros(4, 4)), torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))]
    with pytest.warns(UserWarning, match="stochastic_rounding"):
        opt = FiraAdamW([{"params": params[:1], "rank": 2}, {"params": params[1:]}], lr=1e-3,
                        stochastic_rounding=True)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    saved = opt.state_dict()
    with pytest.warns(UserWarning, match="stochastic_rounding"):
        resumed = FiraAdamW([{"params": params[:1], "rank": 2}, {"params": params[1:]}], lr=1e-3,
                            stochastic_rounding=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned of at the constructor already
        resumed.load_state_dict(saved)
        resumed.step()


def test_stochastic_rounding_switched_on_later_warns_of_fp16_parameters_once() -> None:
    """Set in ``param_groups`` after the constructor, ``stochastic_rounding`` gave fp16 weights,
    which it leaves rounded to nearest, no word (the constructor's warning never ran)."""
    half = torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))
    opt = FiraAdamW([half], lr=1e-3)
    half.grad = torch.ones(4, dtype=torch.float16)
    opt.param_groups[0]["stochastic_rounding"] = True
    with pytest.warns(UserWarning, match=r"param_groups\[0\] holds 1 float16 parameters .* stochastic_rounding "
                                         r"applies to bfloat16"):
        opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per group, not at every step
        opt.step()


def test_a_step_on_meta_parameters_names_the_parameter_and_the_fix() -> None:
    """An optimizer built on a meta-device model, before ``to_empty``, holds parameters that
    model no longer trains; its step failed with "Tensor.item() cannot be called on meta tensors"."""
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    optimizer = FiraAdamW(model.parameters(), rank=4)  # building is allowed, as in torch.optim
    for p in model.parameters():
        p.grad = torch.empty_like(p)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\] \(shape \(16, 16\)\) is on the meta "
                                         r"device: build the optimizer after model.to_empty"):
        optimizer.step()


def test_a_tensor_appended_to_a_projected_group_is_checked_as_add_param_group_checks_it():
    """A 1-D or 3-D tensor appended to a projected group's list during training
    (``opt.param_groups[0]["params"].append(bias)``) trained as plain AdamW without a word, where
    the constructor and add_param_group refuse it."""
    weight = torch.nn.Parameter(torch.randn(8, 24))
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\] has shape \(8,\): a projected group"):
        FiraAdamW([{"params": [weight, torch.nn.Parameter(torch.zeros(8))], "rank": 2}])
    opt = FiraAdamW([{"params": [weight], "rank": 2}])
    weight.grad = torch.randn(8, 24)
    opt.step()
    for extra in (torch.nn.Parameter(torch.zeros(8)), torch.nn.Parameter(torch.zeros(2, 3, 4))):
        opt.param_groups[0]["params"].append(extra)
        extra.grad = torch.ones_like(extra)
        before = weight.detach().clone()
        with pytest.raises(ValueError, match=rf"param_groups\[0\]\['params'\]\[1\] has shape {tuple(extra.shape)}"
                                             .replace("(", r"\(").replace(")", r"\)")):
            opt.step()
        assert torch.equal(weight.detach(), before) and torch.equal(extra.detach(), torch.zeros_like(extra))
        opt.param_groups[0]["params"].pop()


def test_a_refused_group_leaves_no_warning_mark_for_the_next_one_at_its_place() -> None:
    """The once-per-group mark is the group's index: a group refused by add_param_group (after its
    warning) must not leave its index marked for the group added there next."""
    opt = FiraAdamW([torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))], stochastic_rounding=True)
    with pytest.warns(UserWarning, match="holds no bfloat16"), pytest.raises(ValueError, match="complex32"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(4, dtype=torch.complex32))]})
    with pytest.warns(UserWarning, match=r"param_groups\[1\] holds no bfloat16"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(4))]})


@pytest.mark.parametrize("key,option", [("rnak", "rank"), ("update_proj_gaps", "update_proj_gap"),
                                        ("weightdecay", "weight_decay"), ("stochastic_rouding", "stochastic_rounding")])
def test_a_misspelt_group_option_warns_with_the_option_and_the_value_the_group_trains_with(key, option):
    """torch keeps a group's unknown keys, so a misspelt option would be ignored without a word:
    FiraAdamW([{"params": ws, "rnak": 4}]) trained ws with the group's own rank."""
    group = {"params": make_params([(8, 8)]), key: 4}
    with pytest.warns(UserWarning, match=rf"param_groups\[0\] has the key '{key}', which the optimizer does not "
                                         rf"read \(did you mean '{option}'\?\): the group trains with {option}="):
        opt = FiraAdamW([group], rank=2)
    with pytest.warns(UserWarning, match=rf"param_groups\[1\] has the key '{key}'"):
        opt.add_param_group({"params": make_params([(8, 8)]), key: 4})


def test_keys_that_others_read_from_a_group_are_not_taken_for_misspellings():
    """A scheduler's initial_lr, a framework's name or lr_scale, torch's own param_names: kept
    without a warning, as torch.optim.AdamW keeps them."""
    group = {"params": make_params([(8, 8)]), "name": "blocks", "initial_lr": 1e-3, "lr_scale": 0.5,
             "weight_decay_rate": 0.1, "base_lr": 1e-3, "layer_id": 3, "tag": "x", "momentum": 0.9}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FiraAdamW([group], rank=2)


def test_a_misfit_state_names_the_parameter_by_its_name_where_the_optimizer_has_names() -> None:
    """An optimizer built from ``named_parameters()`` names a parameter by its name in every
    error; the check of the states against their groups named it by its place alone."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 4))
    opt = FiraAdamW(model.named_parameters(), rank=2)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    sd = opt.state_dict()
    del sd["state"][1]["basis"]  # the second Linear's weight (the matrices form the first group)
    fresh = FiraAdamW(model.named_parameters(), rank=2)
    with pytest.raises(ValueError, match=r"1\.weight \(param_groups\[0\]\['params'\]\[1\]\) \(shape \(4, 6\)\) has no "
                                         r"projection basis"):
        fresh.load_state_dict(sd)


@pytest.mark.parametrize(("key", "value", "match"), [
    ("state_dtype", "int4", r"param group 0: Invalid state_dtype: 'int4'"),
    ("rank", -3, r"param group 0: Invalid rank: -3"),
])
def test_a_saved_layout_option_no_optimizer_takes_is_refused_as_invalid(key, value, match) -> None:
    """A hand-edited group with ``state_dtype='int4'`` or ``rank=-3`` was told to build the
    optimizer with that value to resume it, which the constructor then refuses."""
    w = torch.nn.Parameter(torch.randn(8, 6))
    opt = FiraAdamW([{"params": [w], "rank": 2}])
    w.grad = torch.randn(8, 6)
    opt.step()
    sd = opt.state_dict()
    sd["param_groups"][0][key] = value
    with pytest.raises(ValueError, match=match) as caught:
        FiraAdamW([{"params": [w], "rank": 2}]).load_state_dict(sd)
    assert "build the optimizer with" not in str(caught.value)


def test_stochastic_rounding_set_in_param_groups_must_be_true_or_false() -> None:
    """Set during training to a string, it was read as true without a word: the constructor's
    check runs at every step, as for the other options torch users set in ``param_groups``."""
    w = torch.nn.Parameter(torch.randn(8, 6, dtype=torch.bfloat16))
    opt = FiraAdamW([{"params": [w], "rank": 2}])
    opt.param_groups[0]["stochastic_rounding"] = "yes"
    w.grad = torch.randn(8, 6, dtype=torch.bfloat16)
    before = w.detach().clone()
    with pytest.raises(ValueError, match=r"Invalid stochastic_rounding: 'yes'; expected True or False"):
        opt.step()
    assert torch.equal(w, before)


def test_a_valid_saved_layout_is_told_apart_from_this_optimizer_s_other_options() -> None:
    """A state dict of int8 states (rounded to nearest) loaded into an optimizer of bf16 states
    with stochastic rounding: the layout error says which state_dtype to build with; the saved
    group was refused as invalid for this optimizer's state_rounding, which the load replaces."""
    w = torch.nn.Parameter(torch.randn(8, 6))
    opt = FiraAdamW([{"params": [w], "rank": 2}], state_dtype="int8")
    w.grad = torch.randn(8, 6)
    opt.step()
    sd = opt.state_dict()
    other = FiraAdamW([{"params": [w], "rank": 2}], state_dtype="bfloat16", state_rounding="stochastic")
    with pytest.raises(ValueError, match=r"saved with state_dtype='int8' but this optimizer's group 0 has "
                                         r"state_dtype='bfloat16'; build the optimizer with state_dtype='int8'"):
        other.load_state_dict(sd)


def _adam_state_dict(w: torch.nn.Parameter) -> dict:
    """torch.optim.Adam's: its groups say decoupled_weight_decay=False (no weight decay: Fira's step)."""
    opt = torch.optim.Adam([w], lr=1e-3)
    w.grad = torch.randn_like(w)
    opt.step()
    return opt.state_dict()


def _fira_state_dict_of_an_earlier_version(w: torch.nn.Parameter) -> dict:
    """Saved before state_dtype and state_rounding existed (fira-optim 0.1.0's groups lack them)."""
    opt = FiraAdamW([w])
    w.grad = torch.randn_like(w)
    opt.step()
    sd = opt.state_dict()
    for group in sd["param_groups"]:
        for key in ("state_dtype", "state_rounding", "stochastic_rounding"):
            group.pop(key, None)
    return sd


@pytest.mark.parametrize("saved", [_adam_state_dict, _fira_state_dict_of_an_earlier_version])
def test_a_valid_saved_layout_value_is_not_refused_for_the_saved_group_s_other_options(saved) -> None:
    """The check of a saved layout value read the whole group: torch.optim.Adam's
    decoupled_weight_decay=False (the load sets it True) and this optimizer's stochastic
    state_rounding beside an earlier version's float32 states (a group saved without the key)
    were each said to be the state dict's invalid option, where the layout differs."""
    w = torch.nn.Parameter(torch.randn(6))
    sd = saved(w)
    other = FiraAdamW([w], state_dtype="bfloat16", state_rounding="stochastic")
    with pytest.raises(ValueError, match=r"saved with state_dtype='float32' \(its group has no 'state_dtype': saved "
                                         r"by an optimizer without that option: torch\.optim's, .*\) but this "
                                         r"optimizer's group 0 has "
                                         r"state_dtype='bfloat16'; build the optimizer with state_dtype='float32' "
                                         r"and state_rounding='nearest' \(stochastic rounding is of bf16 states\)"):
        other.load_state_dict(sd)
