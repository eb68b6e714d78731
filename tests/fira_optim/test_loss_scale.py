"""Loss scaling in the backward pass (fira_optim.LossScale): GradScaler's arithmetic, per update."""

from __future__ import annotations

import contextlib
import copy
import io
import warnings

import pytest
import torch

from fira_optim import FiraAdamW, LossScale, step_in_backward
from tests.fira_optim.test_backward import _batch, _loss, _net, _optimizer
from tests.multiprocess import run_ranks


def _scaled_training(in_backward: bool, steps: int, dynamic: bool, unfreeze_at: int | None = None,
                     overflow_at: int | None = None, device: str = "cpu", autocast: bool = False):
    """Fira on float32 weights, loss scaled at 2**10: step_in_backward with a LossScale, or
    GradScaler and a plain step (``autocast``: under fp16 autocast)."""
    model = _net(torch.float32).to(device)
    if unfreeze_at is not None:
        model.c.weight.requires_grad_(False)  # not hooked at first: optimizer.step() updates it
    opt = _optimizer(model)
    if in_backward:
        handle = step_in_backward(opt, loss_scale=LossScale(2.0 ** 10, growth_interval=2, dynamic=dynamic))
        scaler = handle.loss_scale
    else:
        scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 10, growth_interval=2 if dynamic else 10 ** 9)
    poison = {"on": False}
    model.a.weight.register_hook(lambda g: torch.full_like(g, float("inf")) if poison["on"] else g)
    scales = []
    for step in range(steps):
        if unfreeze_at == step:
            model.c.weight.requires_grad_(True)
        poison["on"] = step == overflow_at
        x, y = (t.to(device) for t in _batch(step, dtype=torch.float32))
        with torch.autocast(device, dtype=torch.float16, enabled=autocast):
            loss = _loss(model, x, y)
        _scaled_step(loss, opt, handle if in_backward else None, scaler)
        scales.append(scaler.get_scale())
    return model, opt, scales


def _scaled_step(loss, opt, handle, scaler) -> None:
    """One update from ``loss``: in the backward pass, scaled by ``handle`` (if given), else by
    the GradScaler ``scaler`` and a plain step."""
    if handle is not None:
        handle.scale(loss).backward()
        opt.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    opt.zero_grad()


@pytest.mark.parametrize(("dynamic", "autocast"), [(False, False), (True, False), (True, True)])
def test_scaled_updates_in_backward_equal_gradscaler_and_step_bit_for_bit(dynamic, autocast):
    (m1, o1, s1), (m2, o2, s2) = (_scaled_training(b, 7, dynamic, unfreeze_at=2, autocast=autocast)
                                  for b in (False, True))
    assert s1 == s2 and (s1[-1] > s1[0]) == dynamic  # grown every 2 clean steps when dynamic
    for p, q in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p, q)
        for key, value in o1.state[p].items():
            assert torch.equal(value, o2.state[q][key]), key


def test_an_overflow_skips_its_matrix_and_backs_the_scale_off():
    model, opt, scales = _scaled_training(True, 3, True, overflow_at=1)
    assert scales == [2.0 ** 10, 2.0 ** 9, 2.0 ** 9]
    # a.weight skipped step 2 (its own count), the others took all three
    assert int(opt.state[model.a.weight]["step"]) == 2 and int(opt.state[model.b.weight]["step"]) == 3
    assert opt._in_backward.loss_scale.skipped == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_fp16_autocast_trains_with_dynamic_scaling():
    model = _net(torch.float32)
    opt = _optimizer(model)
    handle = step_in_backward(opt, loss_scale="dynamic")
    losses = []
    for step in range(12):
        x, y = _batch(0, dtype=torch.float32)  # one batch: the loss must fall
        with torch.autocast("cpu", dtype=torch.float16):
            loss = _loss(model, x, y)
        handle.scale(loss).backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] and handle.loss_scale.get_scale() == 2.0 ** 16


def test_the_scale_resumes_from_its_state_dict_with_weights_only():
    scale = LossScale(8.0, growth_interval=3)
    for _ in range(4):
        scale.update()
    buffer = io.BytesIO()
    torch.save(scale.state_dict(), buffer)
    buffer.seek(0)
    other = LossScale()
    other.load_state_dict(torch.load(buffer, weights_only=True))
    assert other.state_dict() == scale.state_dict() == {
        "scale": 16.0, "_growth_tracker": 1, "growth_factor": 2.0, "backoff_factor": 0.5,
        "growth_interval": 3, "dynamic": True, "skipped": 0}
    with pytest.raises(ValueError, match=r"needs \['_growth_tracker'\]"):
        other.load_state_dict({"scale": 4.0})
    with pytest.raises(ValueError, match=r"a loss-scale state's scale must be a finite number in \(0, 3.4e\+38\], got scale=-1.0"):
        other.load_state_dict({"scale": -1.0, "_growth_tracker": 0})
    with pytest.raises(ValueError, match="got scale=inf"):
        other.load_state_dict({"scale": float("inf"), "_growth_tracker": 0})
    other.load_state_dict({"scale": 1e-40, "_growth_tracker": 0})  # backed off below float32's normal range
    assert 0 < other.get_scale() < 1.2e-38
    # GradScaler's state dict (its tracker is "_growth_tracker")
    gradscaler = torch.amp.GradScaler("cpu", init_scale=32.0, growth_interval=7)
    other.load_state_dict(gradscaler.state_dict())
    assert other.get_scale() == 32.0 and other.growth_interval == 7


def test_a_gradscaler_takes_the_scales_state_dict_and_the_older_layout_still_loads():
    """Both ways with torch.amp.GradScaler (its keys, ours beside them); a state saved by an
    older release named the tracker growth_tracker."""
    scale = LossScale(8.0, growth_interval=3)
    for _ in range(4):
        scale.update()
    gradscaler = torch.amp.GradScaler("cpu")
    gradscaler.load_state_dict(scale.state_dict())
    assert gradscaler.state_dict() == {"scale": 16.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                                       "growth_interval": 3, "_growth_tracker": 1}
    older = LossScale()
    older.load_state_dict({"scale": 16.0, "growth_tracker": 1, "growth_factor": 2.0, "backoff_factor": 0.5,
                           "growth_interval": 3, "dynamic": True, "skipped": 2})
    assert older.state_dict() == {**scale.state_dict(), "skipped": 2}


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"init_scale": 0.0}, r"init_scale must be a finite number in \[1.18e-38, 3.4e\+38\] .*=0.0"),
    ({"init_scale": float("inf")}, "init_scale must be a finite number in"),
    ({"init_scale": 1e39}, "float32's range.*init_scale=1e\\+39"),  # Inf in float32
    ({"init_scale": 1e-50}, "float32's range.*init_scale=1e-50"),  # 0 in float32
    ({"growth_factor": 1.0}, "growth_factor must be a finite number > 1, got growth_factor=1.0"),
    ({"backoff_factor": 1.0}, r"backoff_factor must be a finite number in \(0, 1\), got backoff_factor=1.0"),
    ({"growth_interval": 0}, "growth_interval must be an int >= 1, got growth_interval=0"),
    ({"dynamic": "yes"}, "dynamic must be True or False, got dynamic='yes'"),
])
def test_bad_settings_name_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LossScale(**kwargs)


def test_bad_loss_scale_and_scale_without_one_are_refused():
    model = _net(torch.float32)
    opt = FiraAdamW([{"params": [model.a.weight], "rank": 2}])
    with pytest.raises(ValueError, match="loss_scale must be None, 'dynamic', a number .*got loss_scale='auto'"):
        step_in_backward(opt, loss_scale="auto")
    for bad in (-2, 0, 1e-50, float("inf")):  # named as given, with float32's range
        with pytest.raises(ValueError,
                           match=rf"loss_scale must be a finite number in .*float32's range\), got loss_scale={bad!r}"):
            step_in_backward(opt, loss_scale=bad)
    handle = step_in_backward(opt)
    with pytest.raises(RuntimeError, match="no loss scale: pass loss_scale='dynamic'"):
        handle.scale(torch.ones(()))
    handle.remove()
    assert step_in_backward(opt, loss_scale=128).loss_scale.state_dict()["dynamic"] is False


def test_forgetting_to_scale_the_loss_is_an_error_not_a_gradient_divided_by_the_scale():
    model = _net(torch.float32)
    opt = _optimizer(model)
    handle = step_in_backward(opt, loss_scale="dynamic")
    before = [p.detach().clone() for p in model.parameters()]
    x, y = _batch(0, dtype=torch.float32)
    with pytest.raises(RuntimeError, match=r"not scaled: call handle.scale\(loss\).backward\(\)"):
        _loss(model, x, y).backward()  # the first update refuses: nothing was divided by 2**16
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before)) and handle.loss_scale.skipped == 0


@pytest.mark.parametrize("accumulating", ["first", "last"])
def test_an_unscaled_backward_beside_scaled_ones_is_an_error(accumulating):
    # one micro-batch scaled and one not: accumulated, the unscaled one would weigh 1/S of the other
    model = _net(torch.float32)
    handle = step_in_backward(_optimizer(model), loss_scale=1024.0)
    before = [p.detach().clone() for p in model.parameters()]
    (x0, y0), (x1, y1) = _batch(0, dtype=torch.float32), _batch(1, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="not scaled.*also those inside handle.accumulate"):
        if accumulating == "first":  # the non-final micro-batch unscaled
            with handle.accumulate():
                _loss(model, x0, y0).backward()
        else:  # the final one unscaled, after a scaled one
            with handle.accumulate():
                handle.scale(_loss(model, x0, y0)).backward()
            _loss(model, x1, y1).backward()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_after_an_abandoned_scaled_backward_the_next_step_is_checked_again():
    model = _net(torch.float32)
    opt = _optimizer(model)
    handle = step_in_backward(opt, loss_scale=1024.0)
    x, y = _batch(0, dtype=torch.float32)
    stop = {"on": True}

    def fail_once(grad: torch.Tensor) -> torch.Tensor:
        if stop["on"]:
            raise KeyError("stop")
        return grad

    model.a.weight.register_hook(fail_once)
    with pytest.raises(KeyError, match="stop"):  # its pass ends without its end callback
        handle.scale(_loss(model, x, y)).backward()
    stop["on"] = False
    opt.step()  # ends the step the error cut short
    opt.zero_grad()
    with pytest.raises(RuntimeError, match="not scaled"):  # the abandoned pass counts no longer
        with handle.accumulate():
            _loss(model, x, y).backward()


@pytest.mark.parametrize("block", ["each pass", "the whole loop"])
def test_a_split_backward_runs_inside_scaled_backward_as_one_pass(block):
    # the head's backward from a detached input, then the body's from that input's (scaled) gradient
    def train(split: bool):
        model = _net(torch.float32)
        opt = _optimizer(model)
        handle = step_in_backward(opt, loss_scale=1024.0)
        with contextlib.ExitStack() as loop:
            if split and block == "the whole loop":  # open across optimizer.step()
                loop.enter_context(handle.scaled_backward())
            _train_split(model, opt, handle, split and block == "each pass", split)
        return model

    for p, q in zip(train(False).parameters(), train(True).parameters()):
        assert torch.equal(p, q)


def _train_split(model, opt, handle, mark_each: bool, split: bool) -> None:
    """Three steps; ``split``: the body's backward from the detached head input's gradient,
    inside ``scaled_backward()`` each time when ``mark_each``."""
    for step in range(3):
        x, y = _batch(step, dtype=torch.float32)
        hidden = model.a(x)
        head_input = hidden.detach().requires_grad_() if split else hidden
        out = model.norm(model.c(torch.tanh(model.b(torch.tanh(head_input)))))
        handle.scale((out - y).square().mean()).backward()
        if split:
            if step == 0 and mark_each:  # not marked: refused at the first of a's parameters
                with pytest.raises(RuntimeError, match="handle.scaled_backward"):
                    hidden.backward(head_input.grad, retain_graph=True)
                for p in model.a.parameters():  # accumulated before the hook refused
                    p.grad = None
            with handle.scaled_backward() if mark_each else contextlib.nullcontext():
                hidden.backward(head_input.grad)
        opt.step()
        opt.zero_grad()


def test_a_pipeline_stage_steps_after_its_scaled_backward_block():
    # a stage that never calls scale(): its backward passes start from the next stage's scaled
    # gradients; the final micro-batch inside accumulate() leaves its gradients to optimizer.step()
    def train(in_backward: bool):
        torch.manual_seed(0)
        stage = torch.nn.Linear(8, 6, bias=False)
        opt = FiraAdamW([{"params": [stage.weight], "rank": 2}])
        handle = step_in_backward(opt, loss_scale=1024.0) if in_backward else None
        for step in range(2):
            x, g = torch.randn(4, 8), torch.randn(4, 6)
            if in_backward:
                with handle.scaled_backward(), handle.accumulate():
                    torch.autograd.backward(stage(x), g * 1024.0)
            else:
                torch.autograd.backward(stage(x), g)
            opt.step()
            opt.zero_grad()
        return stage.weight

    assert torch.equal(train(False), train(True))


def test_scaled_backward_passes_in_two_threads_at_once():
    import threading

    left, right = _net(torch.float32), _net(torch.float32)
    params = list(left.parameters()) + list(right.parameters())
    opt = FiraAdamW([{"params": [p for p in params if p.dim() == 2], "rank": 2},
                     {"params": [p for p in params if p.dim() != 2]}])
    handle = step_in_backward(opt, loss_scale=1024.0)
    errors, start = [], threading.Barrier(2)

    def run(model: torch.nn.Module, seed: int) -> None:
        try:
            start.wait()
            for step in range(20):
                x, y = _batch(seed + step, dtype=torch.float32)
                handle.scale(_loss(model, x, y)).backward()
        except BaseException as err:  # noqa: BLE001 -- reported below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(m, 100 * i)) for i, m in enumerate((left, right))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # 20 backward passes per step: warned
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []  # one pass ending does not end the other's mark


def test_the_scale_moves_under_a_float64_default_dtype():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        layer = torch.nn.Linear(8, 8, bias=False, dtype=torch.float32)
        opt = FiraAdamW([{"params": [layer.weight], "rank": 2}])
        handle = step_in_backward(opt, loss_scale=LossScale(growth_interval=1))
        handle.scale(layer(torch.randn(4, 8, dtype=torch.float32)).pow(2).mean()).backward()
        opt.step()  # torch._amp_update_scale_ takes a float32 overflow flag only
    finally:
        torch.set_default_dtype(previous)
    assert handle.loss_scale.get_scale() == 2.0 ** 17


def test_one_scale_serves_one_handle_at_a_time():
    scale = LossScale()
    first = step_in_backward(_optimizer(_net(torch.float32)), loss_scale=scale)
    assert scale.handle is first
    with pytest.raises(ValueError, match="used by another step_in_backward handle"):
        step_in_backward(_optimizer(_net(torch.float32)), loss_scale=scale)
    first.remove()
    assert step_in_backward(_optimizer(_net(torch.float32)), loss_scale=scale).loss_scale is scale


def test_a_refused_handle_leaves_its_scale_free():
    model = _net(torch.float32)
    first = step_in_backward(_optimizer(model))
    scale = LossScale()
    with pytest.raises(ValueError, match="already updated in the backward pass"):
        step_in_backward(_optimizer(model), loss_scale=scale)  # the same weights as first's
    assert scale.handle is None
    first.remove()
    assert step_in_backward(_optimizer(model), loss_scale=scale).loss_scale is scale


def test_fp16_weights_are_refused_as_gradscaler_refuses_their_gradients():
    model = _net(torch.float16)
    with pytest.raises(ValueError, match="loss_scale needs fp32 gradients"):
        step_in_backward(_optimizer(model), loss_scale="dynamic")
    scale = LossScale()
    scale.scale(torch.ones(()))
    with pytest.raises(RuntimeError, match="loss_scale needs fp32 gradients"):
        scale.unscale_([torch.ones(3, dtype=torch.float16)])


def test_an_overflow_in_step_skips_only_its_own_parameter():
    # b and c unfrozen after the hooks were registered: optimizer.step() updates them, together
    model = _net(torch.float32)
    model.b.weight.requires_grad_(False)
    model.c.weight.requires_grad_(False)
    opt = _optimizer(model)
    handle = step_in_backward(opt, loss_scale=LossScale(2.0 ** 10))
    model.b.weight.requires_grad_(True)
    model.c.weight.requires_grad_(True)
    model.b.weight.register_hook(lambda g: torch.full_like(g, float("inf")))
    x, y = _batch(0, dtype=torch.float32)
    handle.scale(_loss(model, x, y)).backward()
    opt.step()
    assert not opt.state.get(model.b.weight) or int(opt.state[model.b.weight]["step"]) == 0
    assert int(opt.state[model.c.weight]["step"]) == 1 and handle.loss_scale.skipped == 1
    assert handle.loss_scale.get_scale() == 2.0 ** 9


def _ddp_overflow_worker(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel

    model = _net(torch.float32)
    wrapped = DistributedDataParallel(model)  # one bucket holds every parameter
    opt = _optimizer(model)
    handle = step_in_backward(opt, wrapped, loss_scale=LossScale(2.0 ** 10))
    poison = {"on": False}
    model.a.weight.register_hook(lambda g: torch.full_like(g, float("inf")) if poison["on"] and rank == 0 else g)
    for step in range(3):
        poison["on"] = step == 1
        x, y = _batch(step, dtype=torch.float32)
        rows = slice(4 * rank, 4 * rank + 4)
        handle.scale(_loss(wrapped, x[rows], y[rows])).backward()
        opt.step()
        opt.zero_grad()
    steps = {name: int(opt.state[p]["step"]) for name, p in model.named_parameters()}
    return steps, handle.loss_scale.skipped, handle.loss_scale.get_scale()


def _ddp_unscaled_micro_batch_worker(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel

    model = _net(torch.float32)
    wrapped = DistributedDataParallel(model)
    handle = step_in_backward(_optimizer(model), wrapped, loss_scale=1024.0)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = _batch(0, dtype=torch.float32)
    rows = slice(4 * rank, 4 * rank + 4)
    try:
        with handle.accumulate():  # under no_sync: DDP's communication hook does not run
            _loss(wrapped, x[rows], y[rows]).backward()
    except RuntimeError as err:
        return str(err), all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    return None, None


@pytest.mark.timeout(120)
def test_under_ddp_an_unscaled_accumulating_micro_batch_is_an_error(tmp_path):
    for message, unchanged in run_ranks(_ddp_unscaled_micro_batch_worker, 2, tmp_path, timeout=100):
        assert message is not None and "not scaled" in message and unchanged


@pytest.mark.timeout(120)
def test_under_ddp_an_overflow_skips_its_parameter_not_its_bucket(tmp_path):
    # rank 0's Inf reaches every rank through the all-reduce: all skip a.weight's update at step 2
    for steps, skipped, scale in run_ranks(_ddp_overflow_worker, 2, tmp_path, timeout=100):
        assert steps["a.weight"] == 2 and skipped == 1 and scale == 2.0 ** 9
        assert all(count == 3 for name, count in steps.items() if name != "a.weight")


@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpointing_runs_its_backward_inside_the_scaled_one(reentrant):
    # reentrant checkpointing recomputes and differentiates its segment in a nested backward pass
    from torch.utils.checkpoint import checkpoint

    def train(in_backward: bool):
        model = _net(torch.float32)
        opt = _optimizer(model)
        handle = step_in_backward(opt, loss_scale=1024.0) if in_backward else None
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=10 ** 9)
        for step in range(3):
            x, y = _batch(step, dtype=torch.float32)
            x = x.requires_grad_(reentrant)  # a reentrant segment needs an input that requires grad
            loss = checkpoint(_loss, model, x, y, use_reentrant=reentrant)
            _scaled_step(loss, opt, handle, scaler)
        return model

    for p, q in zip(train(False).parameters(), train(True).parameters()):
        assert torch.equal(p, q)


def test_compiled_autograd_trains_under_a_loss_scale():
    # compiled autograd runs no end-of-backward callback queued from a hook: the step's check only
    compiled_autograd = pytest.importorskip("torch._dynamo.compiled_autograd")
    if not hasattr(compiled_autograd, "_enable"):
        pytest.skip("this torch has no compiled_autograd._enable")
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 6, bias=False)
    opt = FiraAdamW([{"params": [layer.weight], "rank": 2}])
    handle = step_in_backward(opt, loss_scale=1024.0)
    before = layer.weight.detach().clone()
    with compiled_autograd._enable(torch.compile(backend="eager")):
        handle.scale(layer(torch.randn(4, 8)).square().mean()).backward()  # raised from the hook before
    opt.step()
    assert not torch.equal(layer.weight, before) and layer.weight.grad is None  # updated in the pass


def test_a_loss_scaled_before_a_step_backpropagates_after_it():
    # scale() in one step, backward() in the next: the pass starts from the scaled loss
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 6, bias=False)
    opt = FiraAdamW([{"params": [layer.weight], "rank": 2}])
    handle = step_in_backward(opt, loss_scale=1024.0)
    scaled = handle.scale(layer(torch.randn(4, 8)).square().mean())
    opt.step()
    before = layer.weight.detach().clone()
    scaled.backward()
    assert not torch.equal(layer.weight, before)


def test_a_copy_of_a_scale_is_free_and_checks_again():
    model = _net(torch.float32)
    handle = step_in_backward(_optimizer(model), loss_scale=1024.0)
    with handle.scaled_backward():  # a copy made inside a block, of a scale a handle holds
        copied = copy.deepcopy(handle.loss_scale)
    restored = torch.load(_saved(handle.loss_scale), weights_only=False)
    handle.remove()
    for scale in (copied, restored):
        assert scale.handle is None and scale.get_scale() == 1024.0
        other = step_in_backward(_optimizer(model), loss_scale=scale)  # not "used by another handle"
        x, y = _batch(0, dtype=torch.float32)
        with pytest.raises(RuntimeError, match="not scaled"):  # no block open in the copy
            _loss(model, x, y).backward()
        other.remove()


def _saved(obj) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return buffer
