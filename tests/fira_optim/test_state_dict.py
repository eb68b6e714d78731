"""State and checkpoints (RELIABILITY.md section B): exact resume, weights-only loads, the
zero-gradient step of torch.distributed.checkpoint, loading errors, old state dicts, dtypes."""

import copy

import pytest
import torch

from fira_optim import VARIANTS, FiraAdamW

from .common import (assert_params_equal, assert_states_equal, clone_params, grad_sequence,
                     make_params, round_trip, run, set_grads, state_snapshot)

SHAPES = [(12, 20), (20, 12), (16, 16), (7,), ()]  # wide, tall, square, bias, 0-d
GAP, STEPS = 3, 8


def _optimizer(params, **options):
    options.setdefault("update_proj_gap", GAP)
    projected = [p for p in params if p.dim() == 2]
    plain = [p for p in params if p.dim() != 2]
    return FiraAdamW([{"params": projected, "rank": 3}, {"params": plain}], lr=1e-2,
                     weight_decay=0.01, **options)


def _uninterrupted(options, grads, dtype=torch.float32):
    params = make_params(SHAPES, dtype=dtype)
    opt = _optimizer(params, **options)
    run(opt, params, grads)
    return params, opt


def _resumed(options, grads, k, dtype=torch.float32):
    params = make_params(SHAPES, dtype=dtype)
    opt = _optimizer(params, **options)
    run(opt, params, grads[:k])
    checkpoint = round_trip(opt.state_dict())  # torch.save + torch.load(weights_only=True)
    params_k = [p.detach().clone() for p in params]
    del opt, params
    fresh = clone_params(params_k)
    opt = _optimizer(fresh, **options)
    opt.load_state_dict(checkpoint)
    run(opt, fresh, grads[k:])
    return fresh, opt


@pytest.mark.parametrize("k", [3, 4], ids=["k%T==0", "k%T!=0"])
@pytest.mark.parametrize("projector", ["svd", "randomized", "random"])
def test_resume_is_bitwise_identical(projector, k):
    grads = grad_sequence(SHAPES, STEPS, seed=20)
    options = dict(projector=projector)
    straight, straight_opt = _uninterrupted(options, grads)
    resumed, resumed_opt = _resumed(options, grads, k)
    assert_params_equal(resumed, straight)
    assert_states_equal(state_snapshot(resumed_opt), state_snapshot(straight_opt))
    if k == 3:
        # Not vacuous: continuing with a fresh (unloaded) optimizer gives a different run.
        params = make_params(SHAPES)
        opt = _optimizer(params, **options)
        run(opt, params, grads[:k])
        restarted = clone_params(params)
        run(_optimizer(restarted, **options), restarted, grads[k:])
        assert not torch.equal(restarted[0], straight[0])


@pytest.mark.parametrize("variant", ["galore", "fira-adagrad", "fira-rmsprop", "fira-released",
                                     "fira-shrink"])
@pytest.mark.parametrize("stagger", [False, True])
def test_resume_is_bitwise_identical_for_variants(variant, stagger):
    grads = grad_sequence(SHAPES, STEPS, seed=21)
    options = dict(stagger=stagger, **VARIANTS[variant])
    straight, straight_opt = _uninterrupted(options, grads)
    resumed, resumed_opt = _resumed(options, grads, 4)
    assert_params_equal(resumed, straight)
    assert_states_equal(state_snapshot(resumed_opt), state_snapshot(straight_opt))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_resume_keeps_the_fp32_state_of_low_precision_params(dtype):
    # Device/dtype policy on load: torch casts loaded state to the param's dtype; the basis,
    # the low-rank moments and the limiter history of a bf16/fp16 matrix must stay fp32.
    grads = [[g.to(dtype) for g in row] for row in grad_sequence(SHAPES, STEPS, seed=22)]
    straight, straight_opt = _uninterrupted({}, grads, dtype)
    resumed, resumed_opt = _resumed({}, grads, 4, dtype)
    for p in resumed[:3]:
        for key in ("basis", "exp_avg", "exp_avg_sq", "prev_norm"):
            assert resumed_opt.state[p][key].dtype == torch.float32, key
            assert resumed_opt.state[p][key].device == p.device
    plain = torch.float32 if dtype == torch.float16 else dtype  # plain: torch's policy but fp16
    assert resumed_opt.state[resumed[3]]["exp_avg"].dtype == plain
    assert_params_equal(resumed, straight)
    assert_states_equal(state_snapshot(resumed_opt), state_snapshot(straight_opt))


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize(("saved", "now"), [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                                            (torch.float32, torch.float64), (torch.float16, torch.float32)])
def test_a_state_saved_for_another_param_dtype_loads_in_this_ones_dtypes(saved, now, state_dtype):
    """A model cast to another dtype between save and load: every state takes the dtype a fresh
    optimizer gives it for the parameter as it is now (as torch.optim.AdamW casts), the values
    the saved ones cast, and training steps on (was: the first matrices stepped, then a dtype
    error in the unprojected parameters' update)."""
    grads = grad_sequence(SHAPES, STEPS, seed=23)
    params = make_params(SHAPES, dtype=saved)
    opt = _optimizer(params, state_dtype=state_dtype)
    run(opt, params, [[g.to(saved) for g in row] for row in grads[:4]])
    checkpoint = round_trip(opt.state_dict())
    moved = clone_params([p.detach().to(now) for p in params])
    loaded = _optimizer(moved, state_dtype=state_dtype)
    loaded.load_state_dict(checkpoint)
    fresh_params = clone_params([p.detach().clone() for p in moved])
    fresh = _optimizer(fresh_params, state_dtype=state_dtype)
    run(fresh, fresh_params, [[g.to(now) for g in row] for row in grads[:1]])  # states of these dtypes
    for p, q, old in zip(moved, fresh_params, params):
        for key, value in loaded.state[p].items():
            if key != "step":
                assert value.dtype == fresh.state[q][key].dtype, (tuple(p.shape), key)
                saved_value = opt.state[old][key]
                assert torch.equal(value, saved_value.to(value.dtype)), (tuple(p.shape), key)
    run(loaded, moved, [[g.to(now) for g in row] for row in grads[4:]])
    assert all(torch.isfinite(p).all() for p in moved)
    assert [int(loaded.state[p]["step"]) for p in moved[:3]] == [STEPS] * 3


@pytest.mark.parametrize("in_backward", [False, True])
@pytest.mark.parametrize("state_dtype", ["float32", "int8"])
@pytest.mark.parametrize(("before", "after"), [(torch.float32, torch.float64), (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("loaded_before_the_cast", [False, True])
def test_a_model_cast_mid_training_steps_on_as_after_a_state_dict_round_trip(before, after, state_dtype,
                                                                            in_backward, loaded_before_the_cast):
    """model.to(dtype) after some steps (or after a resume, which leaves no cached layout): the
    same optimizer steps on with its states in the dtypes a load would give them (was: "mat1
    and mat2 must have the same dtype" from deep in the update)."""
    from fira_optim import step_in_backward

    grads = grad_sequence(SHAPES, STEPS, seed=25)
    runs = []
    for reload in (False, True):
        params = make_params(SHAPES, dtype=before)
        opt = _optimizer(params, state_dtype=state_dtype)
        if in_backward:
            step_in_backward(opt)
        for row in grads[:4]:
            _step(opt, params, [g.to(before) for g in row], in_backward)
        if loaded_before_the_cast:
            opt.load_state_dict(round_trip(opt.state_dict()))
        for p in params:
            p.data = p.data.to(after)  # what module.to(dtype) does to each parameter
        if reload:
            opt.load_state_dict(round_trip(opt.state_dict()))
        for row in grads[4:]:
            _step(opt, params, [g.to(after) for g in row], in_backward)
        runs.append((params, opt))
    (cast, cast_opt), (reloaded, reloaded_opt) = runs
    assert_params_equal(cast, reloaded)
    assert_states_equal(state_snapshot(cast_opt), state_snapshot(reloaded_opt))
    assert all(p.dtype == after for p in cast)


@pytest.mark.parametrize("implementation", ["fast", "reference"])
@pytest.mark.parametrize(("shape", "rank", "then", "message"), [
    ((8, 24), 2, (24, 8), r"state 'exp_avg' of param_groups\[0\]\['params'\]\[0\] \(shape \(24, 8\)\) is \(2, 24\)"),
    ((8, 24), 2, (10, 24), r"state 'basis' of param_groups\[0\]\['params'\]\[0\] \(shape \(10, 24\)\) has shape"),
    ((8,), None, (10,), r"state 'exp_avg' of param_groups\[0\]\['params'\]\[0\] has shape \(8,\), expected"),
])
def test_a_parameter_given_data_of_another_shape_mid_training_is_refused_before_anything_changes(
        shape, rank, then, message, implementation):
    """p.data = ... of another shape (a transposed or resized weight) after the states were built:
    the step failed inside the stages (a matrix transposed, after its step counter had moved) with
    torch's shape error naming nothing. The layout records the shapes as it does the dtypes, so
    the states are checked against the parameter's new shape first."""
    param = torch.nn.Parameter(torch.randn(shape))
    opt = FiraAdamW([{"params": [param], "rank": rank}], implementation=implementation)
    param.grad = torch.randn(shape)
    opt.step()
    state = {k: v.clone() for k, v in opt.state[param].items()}
    param.data = torch.randn(then)
    param.grad = torch.randn(then)
    with pytest.raises(ValueError, match=message):
        opt.step()
    assert all(torch.equal(v, state[k]) for k, v in opt.state[param].items())


def _step(opt, params, grads, in_backward):
    """One step from ``grads``: set and ``step()``, or as the backward pass would under
    ``step_in_backward`` (each parameter's gradient accumulated, its hook run)."""
    if not in_backward:
        set_grads(params, grads)
        opt.step()
        return
    for p, g in zip(params, grads):
        (p * g).sum().backward()  # d/dp sum(p * g) = g: the hook updates p
    opt.step()


def test_a_load_post_hook_sees_and_keeps_the_final_states():
    """The dtype policy is applied before the user's load post-hooks, which may replace states."""
    params = make_params(SHAPES)
    opt = _optimizer(params)
    run(opt, params, grad_sequence(SHAPES, 4, seed=24))
    checkpoint = round_trip(opt.state_dict())
    fresh = clone_params([p.detach().clone() for p in params])
    loaded = _optimizer(fresh)
    marker = torch.full_like(checkpoint["state"][0]["exp_avg"], 7.0)

    def replace_first(optimizer) -> None:
        optimizer.state[fresh[0]]["exp_avg"] = marker

    loaded.register_load_state_dict_post_hook(replace_first)
    loaded.load_state_dict(checkpoint)
    assert loaded.state[fresh[0]]["exp_avg"] is marker


def test_state_dict_holds_only_tensors_and_primitives():
    params = make_params(SHAPES)
    opt = _optimizer(params)
    run(opt, params, grad_sequence(SHAPES, 2, seed=23))

    def leaves(obj):
        if isinstance(obj, dict):
            for v in obj.values():
                yield from leaves(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                yield from leaves(v)
        else:
            yield obj

    sd = opt.state_dict()
    assert all(isinstance(x, (torch.Tensor, int, float, str, bool, type(None)))
               for x in leaves(sd))
    loaded = round_trip(sd)
    assert loaded["param_groups"][0]["rank"] == 3
    assert torch.equal(loaded["state"][0]["basis"], opt.state[params[0]]["basis"])


def test_state_dict_before_the_first_step_changes_nothing():
    grads = grad_sequence(SHAPES, STEPS, seed=24)
    straight, straight_opt = _uninterrupted({}, grads)

    params = make_params(SHAPES)
    opt = _optimizer(params)
    early = round_trip(opt.state_dict())
    assert early["state"] == {}
    run(opt, params, grads)
    assert_params_equal(params, straight)
    assert_states_equal(state_snapshot(opt), state_snapshot(straight_opt))

    # Loading that early state dict into a fresh optimizer is a no-op as well.
    params = make_params(SHAPES)
    opt = _optimizer(params)
    opt.load_state_dict(early)
    run(opt, params, grads)
    assert_params_equal(params, straight)


def _dcp_zero_step(opt, params):
    """What torch.distributed.checkpoint / torchtitan do to build optimizer state."""
    saved_lrs = [g["lr"] for g in opt.param_groups]
    set_grads(params, [torch.zeros_like(p) for p in params])
    for g in opt.param_groups:
        g["lr"] = 0.0
    opt.step()
    opt.zero_grad(set_to_none=True)
    for g, lr in zip(opt.param_groups, saved_lrs):
        g["lr"] = lr


@pytest.mark.parametrize("variant", ["fira", "galore", "fira-adagrad"])
def test_dcp_zero_gradient_step_then_training_equals_training(variant):
    grads = grad_sequence(SHAPES, STEPS, seed=25)
    options = VARIANTS[variant]
    straight, straight_opt = _uninterrupted(options, grads)

    params = make_params(SHAPES)
    before = [p.detach().clone() for p in params]
    opt = _optimizer(params, **options)
    _dcp_zero_step(opt, params)
    assert_params_equal(params, before)
    # The state exists with the layout of a trained optimizer (what DCP needs to plan loads).
    sd = round_trip(opt.state_dict())
    assert sorted(sd["state"]) == list(range(len(SHAPES)))
    assert sd["state"][0]["basis"].shape == (12, 3) and sd["state"][1]["basis"].shape == (12, 3)
    # DCP then loads the (here: just taken) state back before training.
    opt.load_state_dict(sd)
    run(opt, params, grads)
    assert_params_equal(params, straight)
    assert_states_equal(state_snapshot(opt), state_snapshot(straight_opt))


# ---------------------------------------------------------------------- loading errors


def _trained_state_dict(shapes=SHAPES, rank=3):
    params = make_params(shapes)
    projected = [p for p in params if p.dim() == 2]
    plain = [p for p in params if p.dim() != 2]
    opt = FiraAdamW([{"params": projected, "rank": rank}, {"params": plain}], lr=1e-2)
    run(opt, params, grad_sequence(shapes, 2, seed=26))
    return round_trip(opt.state_dict())



def test_a_state_dict_loads_into_a_stepped_optimizer_as_into_a_fresh_one():
    # The saved groups' options win, as in torch: a group built with rank=None takes the saved
    # rank. An optimizer that had stepped before the load refused its next step, saying the
    # rank had changed during training.
    sd = _trained_state_dict(rank=3)
    grads = grad_sequence(SHAPES, 3, seed=5)
    runs = []
    for stepped in (False, True):
        params = make_params(SHAPES)
        start = [p.detach().clone() for p in params]
        opt = FiraAdamW([{"params": params[:3]}, {"params": params[3:]}], lr=1e-2)
        if stepped:
            run(opt, params, grads[:1])
            with torch.no_grad():
                for p, p0 in zip(params, start):
                    p.copy_(p0)
        opt.load_state_dict(copy.deepcopy(sd))  # a load shares the state dict's tensors
        assert opt.param_groups[0]["rank"] == 3
        run(opt, params, grads[1:])
        runs.append((params, opt))
    assert_params_equal(runs[0][0], runs[1][0])
    assert_states_equal(state_snapshot(runs[0][1]), state_snapshot(runs[1][1]))


def test_load_with_a_different_number_of_groups_raises_saying_how_to_build_the_optimizer():
    sd = _trained_state_dict()
    params = make_params(SHAPES)
    opt = FiraAdamW([{"params": params[:3], "rank": 3}], lr=1e-2)
    with pytest.raises(ValueError, match=r"the state dict has 2 param groups and this optimizer 1; build the "
                                         r"optimizer with the groups of the saved run"):
        opt.load_state_dict(sd)


def test_load_with_a_group_size_mismatch_raises_saying_how_to_build_the_optimizer():
    sd = _trained_state_dict()
    params = make_params(SHAPES)
    opt = FiraAdamW([{"params": params[:2], "rank": 3}, {"params": params[2:]}], lr=1e-2)
    with pytest.raises(ValueError, match=r"the state dict's param group 0 holds 3 parameters and this optimizer's 2; "
                                         r"build the optimizer with the groups"):
        opt.load_state_dict(sd)


def test_load_of_torch_adamw_groups_of_another_count_says_it_was_not_saved_by_fira():
    """torch's message (a different number of parameter groups) did not say why: a Trainer
    resumed with FiraTrainer from an AdamW checkpoint."""
    params = make_params(SHAPES)
    adamw = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:2]}, {"params": params[2:]}])
    for p in params:
        p.grad = torch.randn_like(p)
    adamw.step()
    opt = FiraAdamW([{"params": params[:3], "rank": 3}, {"params": params[3:]}])
    with pytest.raises(ValueError, match=r"the state dict has 3 param groups and this optimizer 2 \(its groups have "
                                         r"no 'rank': it was not saved by Fira"):
        opt.load_state_dict(adamw.state_dict())


def test_load_of_torch_adamw_groups_whose_first_is_unprojected_says_it_was_not_saved_by_fira():
    """With the unprojected group first, the load told the user to rebuild it with
    state_dtype='float32' (torch's groups have no state_dtype), and only then, rebuilt, that the
    state was not Fira's at all."""
    params = make_params(SHAPES)
    adamw = torch.optim.AdamW([{"params": params[3:]}, {"params": params[:3]}])
    for p in params:
        p.grad = torch.randn_like(p)
    adamw.step()
    opt = FiraAdamW([{"params": params[3:]}, {"params": params[:3], "rank": 3}], state_dtype="int8")
    with pytest.raises(ValueError, match=r"param group 1 has no 'rank': it was not saved by Fira") as caught:
        opt.load_state_dict(adamw.state_dict())
    assert "state_dtype" not in str(caught.value)


def test_load_with_a_wrong_basis_shape_names_the_parameter():
    sd = _trained_state_dict()
    sd["state"][1]["basis"] = torch.zeros(20, 3)  # the tall matrix's basis is 12 x 3
    opt = _optimizer(make_params(SHAPES))
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\].*\(20, 12\)"):
        opt.load_state_dict(sd)


def test_load_with_a_rank_mismatch_names_the_parameter():
    sd = _trained_state_dict(rank=3)
    sd["param_groups"][0]["rank"] = 5  # the saved bases have rank 3
    opt = _optimizer(make_params(SHAPES))
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\].*rank=5"):
        opt.load_state_dict(sd)


def test_load_into_transposed_shapes_names_the_parameter():
    # A wide matrix's state (left basis 12 x 3, moments 3 x 20) loaded onto a tall one.
    sd = _trained_state_dict(shapes=[(12, 20), (7,)])
    params = make_params([(20, 12), (7,)])
    opt = FiraAdamW([{"params": params[:1], "rank": 3}, {"params": params[1:]}], lr=1e-2)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\]"):
        opt.load_state_dict(sd)


def test_load_with_wrong_moment_shape_names_the_parameter():
    sd = _trained_state_dict()
    sd["state"][2]["exp_avg"] = torch.zeros(3, 16)  # square: right projection, moments 16 x 3
    opt = _optimizer(make_params(SHAPES))
    with pytest.raises(ValueError, match=r"'exp_avg'.*param_groups\[0\]\['params'\]\[2\]"):
        opt.load_state_dict(sd)


def test_older_state_dicts_missing_new_group_keys_load_and_continue():
    grads = grad_sequence(SHAPES, STEPS, seed=27)
    straight, straight_opt = _uninterrupted({}, grads)
    params = make_params(SHAPES)
    opt = _optimizer(params)
    run(opt, params, grads[:4])
    sd = round_trip(opt.state_dict())
    # Keep only what fira 1.0.2's groups hold: every later option must default on load.
    released_keys = {"params", "lr", "betas", "eps", "weight_decay", "correct_bias", "rank",
                     "update_proj_gap", "alpha", "proj_type"}
    for g in sd["param_groups"]:
        for key in set(g) - released_keys:
            del g[key]
    assert "limiter" not in sd["param_groups"][0] and "stagger" not in sd["param_groups"][0]
    fresh = clone_params(params)
    opt = _optimizer(fresh)
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["limiter"] == "growth" and opt.param_groups[1]["rank"] is None
    run(opt, fresh, grads[4:])
    assert_params_equal(fresh, straight)
    assert_states_equal(state_snapshot(opt), state_snapshot(straight_opt))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_state_saved_on_cpu_continues_on_cuda():
    # aligned signs: the refresh at step 7 runs on cuSOLVER, which may return a singular vector
    # with the opposite sign to LAPACK's; with raw signs the carried moments would then be read
    # in a flipped basis (tests/fira_optim/test_projection.py), as in any run that changes device
    options = {"align_signs": True}
    grads = grad_sequence(SHAPES, STEPS, seed=28)
    straight, _ = _uninterrupted(options, grads)
    params = make_params(SHAPES)
    opt = _optimizer(params, **options)
    run(opt, params, grads[:4])
    sd = round_trip(opt.state_dict())
    cuda_params = [torch.nn.Parameter(p.detach().cuda()) for p in params]
    opt = _optimizer(cuda_params, **options)
    opt.load_state_dict(sd)
    for p in cuda_params[:3]:
        assert all(v.device == p.device for k, v in opt.state[p].items() if k != "step")
    run(opt, cuda_params, [[g.cuda() for g in row] for row in grads[4:]])
    for p, q in zip(cuda_params, straight):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-4, atol=1e-5)


def test_a_state_dict_saved_by_0_1_0_resumes_bit_for_bit():
    """``data/saved_state_0_1_0.pt`` was written by fira-optim 0.1.0 (before the stages became
    one pipeline, ``data/make_saved_state.py``): today's code loads it with weights_only and
    continues to the parameters that 0.1.0 reached."""
    import os

    path = os.path.join(os.path.dirname(__file__), "data", "saved_state_0_1_0.pt")
    saved = torch.load(path, weights_only=True)

    def build(params, **options):  # as the generator
        return FiraAdamW([{"params": params[:2], "rank": 3, "update_proj_gap": 3}, {"params": params[2:]}],
                         lr=1e-2, weight_decay=0.01, **options)

    params = [torch.nn.Parameter(p.clone()) for p in saved["params"]]
    opt = build(params)
    opt.load_state_dict(saved["optimizer"])
    for row in saved["grads"]:
        for p, g in zip(params, row):
            p.grad = g.clone()
        opt.step()
    # Bit for bit where this machine computes the generator's first steps as the machine that made
    # the file did: another torch build or CPU (seen on torch 2.11, and between an AMD and an Intel
    # CPU, both AVX512) may round an SVD or a sum differently in the last bit; then to round-off.
    shapes = [tuple(p.shape) for p in params]
    replay = make_params(shapes, seed=21)
    first = build(replay, align_signs=True)  # 0.1.0's default
    grads = grad_sequence(shapes, 4 + len(saved["grads"]), seed=22)
    assert all(torch.equal(g, h) for row, saved_row in zip(grads[4:], saved["grads"]) for g, h in zip(row, saved_row))
    run(first, replay, grads[:4])
    same_platform = all(torch.equal(p.detach(), q) for p, q in zip(replay, saved["params"]))
    for p, want in zip(params, saved["final"]):
        if same_platform:
            assert torch.equal(p.detach(), want)
        else:
            torch.testing.assert_close(p.detach(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("state_dtype", ["int8", "bfloat16"])
def test_a_state_dict_saved_before_state_dtype_is_refused_by_a_low_precision_optimizer(state_dtype):
    """0.1.0's groups have no ``state_dtype``: their states are float32. Loaded into an int8
    optimizer they were kept as float32 moments under an int8 group (no memory saved, the next
    state dict labelled int8), into a bf16 one rounded silently; a float32 optimizer still
    takes them, as a state dict that names its dtype."""
    import os

    path = os.path.join(os.path.dirname(__file__), "data", "saved_state_0_1_0.pt")
    saved = torch.load(path, weights_only=True)
    assert all("state_dtype" not in g for g in saved["optimizer"]["param_groups"])

    def build(**options):  # as the generator
        params = [torch.nn.Parameter(p.clone()) for p in saved["params"]]
        return FiraAdamW([{"params": params[:2], "rank": 3, "update_proj_gap": 3}, {"params": params[2:]}],
                         lr=1e-2, weight_decay=0.01, **options)

    low = build(state_dtype=state_dtype)
    with pytest.raises(ValueError, match=r"saved with state_dtype='float32' \(its group has no 'state_dtype': "
                                         r"saved by an optimizer without that option: torch\.optim's, the released "
                                         r"fira's, galore-torch's, or fira-optim's before it\) but this optimizer's "
                                         r"group 0 has "
                                         rf"state_dtype='{state_dtype}'; build the optimizer with state_dtype='float32'"):
        low.load_state_dict(saved["optimizer"])
    assert not low.state and low.param_groups[0]["state_dtype"] == state_dtype  # nothing loaded
    fp32 = build()
    fp32.load_state_dict(saved["optimizer"])
    assert fp32.param_groups[0]["state_dtype"] == "float32" and len(fp32.state) == len(saved["optimizer"]["state"])
    # float32 groups under a low-precision default: the loaded groups stay float32 (torch's load
    # takes the saved groups, and the optimizer filled their missing key from its default)
    params = [torch.nn.Parameter(p.clone()) for p in saved["params"]]
    mixed = FiraAdamW([{"params": params[:2], "rank": 3, "update_proj_gap": 3, "state_dtype": "float32"},
                       {"params": params[2:], "state_dtype": "float32"}], lr=1e-2, weight_decay=0.01,
                      state_dtype=state_dtype)
    mixed.load_state_dict(saved["optimizer"])
    assert [g["state_dtype"] for g in mixed.param_groups] == ["float32", "float32"]


def test_a_state_loaded_into_groups_in_another_order_asks_about_the_order():
    """A plain group and a projected one given in the other order than when saved: the bias at
    the saved matrix's place is refused, with the order named as the likely cause (the message
    read as if a bias had been projected)."""
    weight, bias = torch.nn.Parameter(torch.randn(6, 8)), torch.nn.Parameter(torch.randn(6))
    opt = FiraAdamW([{"params": [weight], "rank": 2}, {"params": [bias]}])
    weight.grad, bias.grad = torch.randn(6, 8), torch.randn(6)
    opt.step()
    swapped = FiraAdamW([{"params": [bias]}, {"params": [weight], "rank": 2}])
    with pytest.raises(ValueError, match=r"\(shape \(6,\)\) holds a projection basis.*a 1-D parameter is never "
                                         r"projected, so the state is another parameter's: are the groups"):
        swapped.load_state_dict(opt.state_dict())


def test_a_state_saved_by_another_algorithm_warns_that_the_saved_one_goes_on():
    """Loading restores every group option, as torch's optimizers do: a GaLore optimizer built to
    resume a Fira run trained Fira from then on, without a word."""
    import warnings

    from fira_optim import GaLoreAdamW

    w = torch.nn.Parameter(torch.randn(6, 8))
    opt = FiraAdamW([{"params": [w], "rank": 2}])
    w.grad = torch.randn(6, 8)
    opt.step()
    galore = GaLoreAdamW([{"params": [w], "rank": 2}])
    with pytest.warns(UserWarning, match=r"param group 0 was saved with residual='add', which it loads in place of "
                                         r"this optimizer's residual='drop'.*the run goes on as it was saved") as record:
        galore.load_state_dict(opt.state_dict())
    assert galore.param_groups[0]["residual"] == "add"
    assert record[0].filename == __file__  # the caller's line, not torch's
    with warnings.catch_warnings():  # the same algorithm: no warning
        warnings.simplefilter("error")
        FiraAdamW([{"params": [w], "rank": 2}]).load_state_dict(opt.state_dict())


def test_a_state_saved_with_other_rounding_warns_that_the_saved_one_goes_on():
    """A run resumed with stochastic rounding turned on (weights and bf16 states) went on rounding
    to nearest, as saved, without a word."""
    w = torch.nn.Parameter(torch.randn(6, 8, dtype=torch.bfloat16))
    opt = FiraAdamW([{"params": [w], "rank": 2}], state_dtype="bfloat16")
    w.grad = torch.randn(6, 8, dtype=torch.bfloat16)
    opt.step()
    resumed = FiraAdamW([{"params": [w], "rank": 2}], state_dtype="bfloat16", state_rounding="stochastic",
                        stochastic_rounding=True)
    with pytest.warns(UserWarning, match=r"param group 0 was saved with state_rounding='nearest', "
                                         r"stochastic_rounding=False, which it loads in place of this optimizer's "
                                         r"state_rounding='stochastic', stochastic_rounding=True"):
        resumed.load_state_dict(opt.state_dict())
    assert resumed.param_groups[0]["state_rounding"] == "nearest"
    assert resumed.param_groups[0]["stochastic_rounding"] is False


def _set(index, key, value):
    def mutate(sd):
        sd["state"][index][key] = value(sd["state"][index]) if callable(value) else value
    return mutate


def _group(index, key, value):
    def mutate(sd):
        sd["param_groups"][index][key] = value
    return mutate


def _filled_with(number):
    return lambda entry: torch.full_like(entry["exp_avg"], number)


# ids 0-2: the projected matrices (group 0), 3 and 4: the bias and the 0-d parameter (group 1)
_PLAIN = r"param_groups\[1\]\['params'\]\[0\]"
_MATRIX = r"param_groups\[0\]\['params'\]\[0\]"
MALFORMED = {
    # values that no step leaves, loaded without a word
    "negative-second-moment": (_set(3, "exp_avg_sq", _filled_with(-1.0)),
                               rf"'exp_avg_sq' of {_PLAIN}.*negative.*-1"),
    "negative-low-rank-second-moment": (_set(0, "exp_avg_sq", lambda e: -e["exp_avg_sq"] - 1),
                                        rf"'exp_avg_sq' of {_MATRIX}.*negative"),
    "nan-step": (_set(3, "step", torch.tensor(float("nan"))), rf"'step' of {_PLAIN}.*nan"),
    "negative-step": (_set(3, "step", torch.tensor(-5.0)), rf"'step' of {_PLAIN}.*-5"),
    "negative-and-nan-second-moment": (_set(3, "exp_avg_sq", lambda e: torch.tensor([float("nan"), -2.0] * 3 + [1.0])),
                                       rf"'exp_avg_sq' of {_PLAIN}.*negative.*-2"),
    "fractional-step": (_set(3, "step", torch.tensor(2.5)), rf"'step' of {_PLAIN}.*2\.5"),
    "string-step": (_set(3, "step", "4"), rf"'step' of {_PLAIN}.*'4'"),
    "huge-int-step": (_set(3, "step", 10**400), rf"'step' of {_PLAIN}.*1000000"),
    "step-of-three-elements": (_set(3, "step", torch.tensor([4.0, 4.0, 4.0])), rf"'step' of {_PLAIN}.*3 elements"),
    "complex-moment": (_set(3, "exp_avg", lambda e: e["exp_avg"].to(torch.complex64)),
                       rf"'exp_avg' of {_PLAIN}.*complex64"),
    "meta-moment": (_set(3, "exp_avg", lambda e: torch.empty_like(e["exp_avg"], device="meta")),
                    rf"'exp_avg' of {_PLAIN}.*meta"),
    "list-moment": (_set(3, "exp_avg", [0.0] * 7), rf"'exp_avg' of {_PLAIN}.*list"),
    # keys a step reads: the step failed with a bare KeyError after the load
    "no-step": (lambda sd: sd["state"][3].pop("step"), rf"{_PLAIN}.*has no 'step'"),
    "no-second-moment": (lambda sd: sd["state"][4].pop("exp_avg_sq"),
                         r"param_groups\[1\]\['params'\]\[1\].*has no 'exp_avg_sq'"),
    "no-low-rank-step": (lambda sd: sd["state"][1].pop("step"), r"param_groups\[0\]\['params'\]\[1\].*has no 'step'"),
    # the structure: torch's own errors named nothing, or the state went to no parameter
    "state-not-a-dict": (lambda sd: sd.__setitem__("state", [1, 2]), r"'state'.*list"),
    "entry-not-a-dict": (lambda sd: sd["state"].__setitem__(3, 5), r"state of parameter id 3 is 5"),
    "state-of-no-parameter": (lambda sd: sd["state"].__setitem__(99, sd["state"][3]), r"parameter id 99"),
    "ids-renumbered": (_group(1, "params", ["a", "b"]), r"parameter id 3"),
    "id-listed-twice": (_group(1, "params", [3, 0]), r"parameter id 0.*twice"),
    # group options the constructor refuses
    "nan-lr": (_group(0, "lr", float("nan")), r"param group 0.*lr: nan"),
    "negative-lr": (_group(1, "lr", -1.0), r"param group 1.*lr.*-1"),
    "string-lr": (_group(0, "lr", "0.01"), r"param group 0.*lr: '0.01'"),
    "beta-above-one": (_group(0, "betas", (1.5, 0.999)), r"param group 0.*betas.*1\.5"),
    "negative-eps": (_group(1, "eps", -1.0), r"param group 1.*eps.*-1"),
    "nan-weight-decay": (_group(0, "weight_decay", float("nan")), r"param group 0.*weight_decay: nan"),
    "zero-gap": (_group(0, "update_proj_gap", 0), r"param group 0.*update_proj_gap: 0"),
    "negative-gap": (_group(0, "update_proj_gap", -1), r"param group 0.*update_proj_gap: -1"),
    "nan-alpha": (_group(0, "alpha", float("nan")), r"param group 0.*alpha: nan"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_state_dict_is_refused_naming_the_key_and_value(case):
    """A state dict that is damaged or crafted (a checkpoint from elsewhere) is refused before
    anything is loaded, naming the parameter, the key and the value. These loaded without a
    word and trained NaN, or on a fresh state (a state keyed by ids no group lists), or with
    options the constructor refuses; or failed with an error of torch's naming nothing
    (KeyError: 'step', "Cannot copy out of meta tensor")."""
    mutate, message = MALFORMED[case]
    sd = _trained_state_dict()
    mutate(sd)
    params = make_params(SHAPES)
    opt = _optimizer(params)
    run(opt, params, grad_sequence(SHAPES, 1, seed=3))
    before = state_snapshot(opt)
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(sd)
    assert_states_equal(state_snapshot(opt), before)  # nothing was loaded


@pytest.mark.parametrize("case", ["nan-moment", "inf-low-rank-moment", "nan-basis", "nan-limiter-norm"])
def test_a_state_with_nan_or_inf_loads_as_saved_with_a_warning(case):
    """NaN or Inf in a state is what a step can leave (an overflowing second moment,
    ``nonfinite="ignore"``): loaded as saved, with one warning naming where, not refused (such a
    run could not be resumed at all)."""
    mutate, index, key, where = {
        "nan-moment": (_set(3, "exp_avg", _filled_with(float("nan"))), 3, "exp_avg", _PLAIN),
        "inf-low-rank-moment": (_set(0, "exp_avg", _filled_with(float("inf"))), 0, "exp_avg", _MATRIX),
        "nan-basis": (_set(0, "basis", lambda e: torch.full_like(e["basis"], float("nan"))), 0, "basis", _MATRIX),
        "nan-limiter-norm": (_set(0, "prev_norm", torch.tensor(float("nan"))), 0, "prev_norm", _MATRIX),
    }[case]
    sd = _trained_state_dict()
    mutate(sd)
    params = make_params(SHAPES)
    opt = _optimizer(params)
    with pytest.warns(UserWarning, match=rf"holds NaN or Inf in '{key}' of {where}.*loaded as saved") as caught:
        opt.load_state_dict(sd)
    assert len([w for w in caught if "NaN or Inf" in str(w.message)]) == 1
    loaded = opt.state[params[index]][key]
    assert not torch.isfinite(loaded).all()


def test_a_second_moment_an_overflowing_step_left_resumes_bit_for_bit():
    """A finite gradient of 3e21 on the bias (not projected) makes its second moment Inf, as in
    torch.optim.AdamW: the checkpoint was refused as damaged, and the run could not be resumed.
    It loads now, with a warning, and goes on as the uninterrupted run does."""
    grads = grad_sequence(SHAPES, 6, seed=22)
    grads[1][3] = torch.full_like(grads[1][3], 3e21)
    straight, straight_opt = _uninterrupted({}, grads)
    assert torch.isinf(straight_opt.state[straight[3]]["exp_avg_sq"]).all()
    with pytest.warns(UserWarning, match=r"holds NaN or Inf in 'exp_avg_sq' of param_groups\[1\]"):
        resumed, resumed_opt = _resumed({}, grads, 3)
    assert_params_equal(resumed, straight)
    assert_states_equal(state_snapshot(resumed_opt), state_snapshot(straight_opt))


def test_a_nan_state_that_nonfinite_ignore_let_through_resumes_bit_for_bit():
    """Under ``nonfinite="ignore"`` a NaN gradient reaches the bias's moments. The checkpoint loads
    with a warning, and the resumed run's NaN sit where the uninterrupted run's do, bit for bit."""
    grads = grad_sequence(SHAPES, 6, seed=23)
    grads[1][3][0] = float("nan")
    options = {"nonfinite": "ignore"}
    straight, straight_opt = _uninterrupted(options, grads)
    assert torch.isnan(straight_opt.state[straight[3]]["exp_avg"]).any()
    with pytest.warns(UserWarning, match=r"holds NaN or Inf in 'exp_avg'"):
        resumed, resumed_opt = _resumed(options, grads, 3)
    assert_params_equal(resumed, straight)
    assert_states_equal(state_snapshot(resumed_opt), state_snapshot(straight_opt))
    # and the comparison still sees a NaN that moved
    moved = state_snapshot(resumed_opt)
    moved[3]["exp_avg"] = moved[3]["exp_avg"].roll(1)
    with pytest.raises(AssertionError, match="exp_avg differs"):
        assert_states_equal(moved, state_snapshot(straight_opt))


def test_a_state_dict_at_the_edges_of_the_checks_loads():
    """What the checks above must let through: a step of 0 (no step taken yet), a state of
    zeros, a step saved as a plain int (older torch) and an int step tensor."""
    sd = _trained_state_dict()
    sd["state"][3]["step"] = 0
    sd["state"][4]["step"] = torch.tensor(2, dtype=torch.int64)
    sd["state"][3]["exp_avg_sq"] = torch.zeros_like(sd["state"][3]["exp_avg_sq"])
    params = make_params(SHAPES)
    opt = _optimizer(params)
    opt.load_state_dict(sd)
    run(opt, params, grad_sequence(SHAPES, 2, seed=4))
    assert all(torch.isfinite(p).all() for p in params)


def test_a_load_warning_through_torchs_distributed_state_dict_helper_names_the_callers_line():
    """fira-train loads a DCP checkpoint's optimizer state with torch's ``set_optimizer_state_dict``,
    which calls ``load_state_dict``: the NaN warning pointed at a line of torch's
    ``torch/distributed/checkpoint/state_dict.py``, not at the line that loaded the checkpoint."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    params = make_params(SHAPES)
    model = torch.nn.Module()
    for i, p in enumerate(params):
        model.register_parameter(f"p{i}", p)
    opt = _optimizer(params)
    run(opt, params, grad_sequence(SHAPES, 2, seed=1))
    sd = get_optimizer_state_dict(model, opt)
    next(iter(sd["state"].values()))["exp_avg"].fill_(float("nan"))
    with pytest.warns(UserWarning, match="holds NaN or Inf") as caught:
        set_optimizer_state_dict(model, _optimizer(params), sd)
    assert [w.filename for w in caught if "NaN or Inf" in str(w.message)] == [__file__]
