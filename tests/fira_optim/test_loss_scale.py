"""Loss scaling in the backward pass (fira_optim.LossScale): GradScaler's arithmetic, per update."""

from __future__ import annotations

import io

import pytest
import torch

from fira_optim import FiraAdamW, LossScale, step_in_backward
from tests.fira_optim.test_backward import _batch, _loss, _net, _optimizer


def _scaled_training(in_backward: bool, steps: int, dynamic: bool, unfreeze_at: int | None = None,
                     overflow_at: int | None = None):
    """Fira on float32 weights, loss scaled at 2**10: step_in_backward with a LossScale, or
    GradScaler and a plain step."""
    model = _net(torch.float32)
    if unfreeze_at is not None:
        model.c.weight.requires_grad_(False)  # not hooked at first: optimizer.step() updates it
    opt = _optimizer(model)
    if in_backward:
        handle = step_in_backward(opt, loss_scale=LossScale(2.0 ** 10, growth_interval=2, dynamic=dynamic))
        scaler = handle.loss_scale
    else:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2 if dynamic else 10 ** 9)
    poison = {"on": False}
    model.a.weight.register_hook(lambda g: torch.full_like(g, float("inf")) if poison["on"] else g)
    scales = []
    for step in range(steps):
        if unfreeze_at == step:
            model.c.weight.requires_grad_(True)
        poison["on"] = step == overflow_at
        x, y = _batch(step, dtype=torch.float32)
        loss = _loss(model, x, y)
        if in_backward:
            handle.scale(loss).backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return model, opt, scales


@pytest.mark.parametrize("dynamic", [False, True])
def test_scaled_updates_in_backward_equal_gradscaler_and_step_bit_for_bit(dynamic):
    (m1, o1, s1), (m2, o2, s2) = (_scaled_training(b, 7, dynamic, unfreeze_at=2) for b in (False, True))
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
        "scale": 16.0, "growth_tracker": 1, "growth_factor": 2.0, "backoff_factor": 0.5,
        "growth_interval": 3, "dynamic": True}
    with pytest.raises(ValueError, match=r"needs \['growth_tracker'\]"):
        other.load_state_dict({"scale": 4.0})
    with pytest.raises(ValueError, match="init_scale must be a finite number > 0, got init_scale=-1"):
        other.load_state_dict({"scale": -1.0, "growth_tracker": 0})


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"init_scale": 0.0}, "init_scale must be a finite number > 0, got init_scale=0.0"),
    ({"init_scale": float("inf")}, "init_scale must be a finite number > 0"),
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
    with pytest.raises(ValueError, match="loss_scale must be None, 'dynamic', a number > 0.*got loss_scale='auto'"):
        step_in_backward(opt, loss_scale="auto")
    with pytest.raises(ValueError, match="init_scale must be a finite number > 0, got init_scale=-2"):
        step_in_backward(opt, loss_scale=-2)
    handle = step_in_backward(opt)
    with pytest.raises(RuntimeError, match="no loss scale: pass loss_scale='dynamic'"):
        handle.scale(torch.ones(()))
    handle.remove()
    assert step_in_backward(opt, loss_scale=128).loss_scale.state_dict()["dynamic"] is False
