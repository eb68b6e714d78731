"""Step-for-step parity with the released implementations (same gradients injected).

- ``FiraAdamW(arithmetic="released")`` against ``fira.FiraAdamW`` 1.0.2, on the very group dicts
  that ``fira.divide_params`` builds (a group is projected iff it has a ``rank`` key);
- ``GaLoreAdamW`` against ``galore_torch.GaLoreAdamW`` 1.0 (group key ``scale``).

Runs cross three projection refreshes, on tall, wide and square matrices, with weight decay.
"""

import copy
import warnings

import pytest
import torch
from torch import nn

import fira
from fira_optim import FiraAdamW, GaLoreAdamW

from .common import grad_sequence
from .released import galore_adamw_class, quiet_fira_divide_params

RANK, GAP, ALPHA, LR, STEPS = 4, 3, 0.25, 1e-2, 10  # refreshes at steps 0, 3, 6, 9
TARGETS = ["attn", "mlp"]


class Block(nn.Module):
    """Tall, wide and square projected weights, plus biases, a norm and an untargeted head."""

    def __init__(self):
        super().__init__()
        self.attn_q = nn.Linear(16, 16)  # weight 16 x 16: square (right, by the tie rule)
        self.mlp_up = nn.Linear(12, 20)  # weight 20 x 12: tall (right)
        self.mlp_down = nn.Linear(20, 12)  # weight 12 x 20: wide (left)
        self.norm = nn.LayerNorm(12)
        self.head = nn.Linear(12, 3)  # not a target: in the plain group


def _models(dtype):
    torch.manual_seed(0)
    a = Block().to(dtype)
    return a, copy.deepcopy(a)


def _inject(model, grads):
    for p, g in zip(model.parameters(), grads, strict=True):
        p.grad = g.clone()


def _svd_in_gradient_dtype(self, weights, rank, type):
    # fira 1.0.2 runs its SVD in fp32 even for fp64 gradients; our fp64 path runs it in fp64.
    # To compare the *arithmetic* at fp64 precision the released projector gets an fp64 SVD
    # here (same LAPACK call on the same matrix as ours, so the same basis).
    u, _, vh = torch.linalg.svd(weights, full_matrices=False)
    return vh[:rank, :] if type == "right" else u[:, :rank]


TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float64: dict(rtol=1e-11, atol=1e-13)}


@pytest.mark.parametrize("dtype,correct_bias", [(torch.float32, True), (torch.float64, True),
                                                (torch.float32, False)])
@pytest.mark.parametrize("proj_type", ["std", "reverse_std", "left", "right"])
def test_released_arithmetic_matches_fira_1_0_2(dtype, correct_bias, proj_type, monkeypatch):
    if dtype == torch.float64:
        monkeypatch.setattr(fira.gradient_projection.GradientProjector, "get_orthogonal_matrix",
                            _svd_in_gradient_dtype)
    ref_model, our_model = _models(dtype)
    groups = dict(target_modules_list=TARGETS, rank=RANK, update_proj_gap=GAP, alpha=ALPHA,
                  proj_type=proj_type)
    ref = fira.FiraAdamW(quiet_fira_divide_params(ref_model, **groups), lr=LR, eps=1e-8,
                         weight_decay=0.1, correct_bias=correct_bias, no_deprecation_warning=True)
    # The same group dicts, unchanged: ours reads "rank" as "this group is projected".
    ours = FiraAdamW(quiet_fira_divide_params(our_model, **groups), lr=LR, eps=1e-8,
                     weight_decay=0.1, correct_bias=correct_bias, arithmetic="released",
                     align_signs=False)  # fira keeps whatever signs the SVD returns
    assert [len(g["params"]) for g in ours.param_groups] == [7, 3]
    assert ours.param_groups[0]["rank"] is None and ours.param_groups[1]["rank"] == RANK

    initial = [p.detach().clone() for p in our_model.parameters()]
    shapes = [tuple(p.shape) for p in ref_model.parameters()]
    projected = [ref_model.attn_q.weight, ref_model.mlp_up.weight, ref_model.mlp_down.weight]
    ours_projected = [our_model.attn_q.weight, our_model.mlp_up.weight, our_model.mlp_down.weight]
    prev_norms = []
    for k, grads in enumerate(grad_sequence(shapes, STEPS, seed=3, dtype=dtype)):
        _inject(ref_model, grads)
        _inject(our_model, grads)
        ref.step()
        ours.step()
        for (name, p), q in zip(ref_model.named_parameters(), our_model.parameters()):
            torch.testing.assert_close(q, p, **TOL[dtype], msg=lambda m: f"step {k} {name}: {m}")
        prev_norms.append(float(ours.state[our_model.mlp_down.weight]["prev_norm"]))

    # The released state, translated: moments and basis agree too.
    for p, q in zip(projected, ours_projected):
        ref_state, our_state = ref.state[p], ours.state[q]
        basis = ref_state["projector"].ortho_matrix  # right: Vh[:r] (r x n); left: U[:, :r]
        our_basis = our_state["basis"]
        if basis.shape != our_basis.shape:
            our_basis = our_basis.T
        torch.testing.assert_close(our_basis, basis, **TOL[dtype])
        torch.testing.assert_close(our_state["exp_avg"], ref_state["exp_avg"], **TOL[dtype])
        torch.testing.assert_close(our_state["exp_avg_sq"], ref_state["exp_avg_sq"], **TOL[dtype])
        torch.testing.assert_close(our_state["prev_norm"], ref_state["scaling_grad"].to(dtype),
                                   **TOL[dtype])
        assert int(our_state["step"]) == ref_state["step"] == STEPS

    # Not a vacuous comparison: every param moved well beyond the tolerance, and the limiter
    # engaged on the 20x gradient of step 5 (the stored norm grew by exactly gamma).
    for p0, p in zip(initial, our_model.parameters()):
        assert (p.detach() - p0).abs().max() > 1e-3
    assert prev_norms[5] == pytest.approx(1.01 * prev_norms[4], rel=1e-5)


def _galore_groups(model, **extra):
    projected = [model.attn_q.weight, model.mlp_up.weight, model.mlp_down.weight]
    chosen = {id(p) for p in projected}
    regular = [p for p in model.parameters() if id(p) not in chosen]
    return [{"params": regular},
            {"params": projected, "rank": RANK, "update_proj_gap": GAP, "scale": ALPHA,
             "proj_type": "std", **extra}]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("weight_decay,arithmetic", [(0.1, "released"), (0.0, "released"),
                                                     (0.0, "paper")])
def test_galore_matches_galore_torch_1_0(dtype, weight_decay, arithmetic):
    ref_model, our_model = _models(dtype)
    # galore-torch runs its SVD in fp32 for fp64 gradients too: compare fp64 at fp32 level
    # (the SVD is the only fp32 step; the rest of the arithmetic is checked by the fira test).
    tol = TOL[torch.float32]
    ref = galore_adamw_class()(_galore_groups(ref_model), lr=LR, eps=1e-8,
                               weight_decay=weight_decay, no_deprecation_warning=True)
    ours = GaLoreAdamW(_galore_groups(our_model), lr=LR, eps=1e-8, weight_decay=weight_decay,
                       arithmetic=arithmetic, align_signs=False)  # galore-torch: raw SVD signs
    assert ours.param_groups[1]["alpha"] == ALPHA  # galore's "scale" read as alpha
    initial = [p.detach().clone() for p in our_model.parameters()]
    shapes = [tuple(p.shape) for p in ref_model.parameters()]
    for k, grads in enumerate(grad_sequence(shapes, STEPS, seed=4, dtype=dtype)):
        _inject(ref_model, grads)
        _inject(our_model, grads)
        ref.step()
        ours.step()
        for (name, p), q in zip(ref_model.named_parameters(), our_model.parameters()):
            torch.testing.assert_close(q, p, **tol, msg=lambda m: f"step {k} {name}: {m}")
    for p0, p in zip(initial, our_model.parameters()):
        assert (p.detach() - p0).abs().max() > 1e-3
    # GaLore keeps no residual history.
    assert "prev_norm" not in ours.state[our_model.mlp_up.weight]


def _continued(ref_model, our_model, ref, ours_for):
    """``ref`` steps 4 times, then ``ours_for()`` (built on ``our_model``, given ``ref_model``'s
    weights) loads its state dict and both step on, across the refreshes at steps 6 and 9: the
    weights must stay equal. Returns our optimizer."""
    shapes = [tuple(p.shape) for p in ref_model.parameters()]
    grads = grad_sequence(shapes, STEPS, seed=3)
    for row in grads[:4]:
        _inject(ref_model, row)
        ref.step()
    with torch.no_grad():
        for p, q in zip(our_model.parameters(), ref_model.parameters()):
            p.copy_(q)
    ours = ours_for()
    ours.load_state_dict(copy.deepcopy(ref.state_dict()))
    for row in grads[4:]:
        _inject(ref_model, row)
        _inject(our_model, row)
        ref.step()
        ours.step()
    for p, q in zip(our_model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, **TOL[torch.float32])
    return ours


def test_a_run_of_fira_1_0_2_continues_under_fira_optim():
    """Migration: ``fira.FiraAdamW``'s state dict (pickled projector objects, int steps, its
    limiter norm ``scaling_grad``) loads into ``FiraAdamW(arithmetic="released")``, which then
    takes the very steps the released package would have taken."""
    ref_model, our_model = _models(torch.float32)
    groups = dict(target_modules_list=TARGETS, rank=RANK, update_proj_gap=GAP, alpha=ALPHA)
    ref = fira.FiraAdamW(quiet_fira_divide_params(ref_model, **groups), lr=LR, eps=1e-8,
                         weight_decay=0.1, no_deprecation_warning=True)
    ours = _continued(ref_model, our_model, ref, lambda: FiraAdamW(
        quiet_fira_divide_params(our_model, **groups), lr=LR, eps=1e-8, weight_decay=0.1,
        arithmetic="released", align_signs=False))
    projected = ours.param_groups[1]["params"]
    assert all(ours.state[p]["basis"].shape == (min(p.shape), RANK) for p in projected)


def test_a_run_of_galore_torch_continues_under_galore_adamw():
    """Migration: ``galore_torch.GaLoreAdamW``'s state dict (pickled projector objects, int
    steps, the group key ``scale``) loads into ``GaLoreAdamW(arithmetic="released")``, which then
    takes the very steps galore-torch would have taken. (The saved groups replace the
    optimizer's, and their ``scale`` used to be dropped for the default ``alpha``.)"""
    ref_model, our_model = _models(torch.float32)
    scale = 2 * ALPHA  # not the constructor's default alpha
    ref = galore_adamw_class()(_galore_groups(ref_model, scale=scale), lr=LR, eps=1e-8,
                               weight_decay=0.1, no_deprecation_warning=True)
    ours = _continued(ref_model, our_model, ref, lambda: GaLoreAdamW(
        _galore_groups(our_model, scale=scale), lr=LR, eps=1e-8, weight_decay=0.1,
        arithmetic="released", align_signs=False))
    assert ours.param_groups[1]["alpha"] == scale


def test_a_released_state_loaded_with_the_paper_arithmetic_is_warned_of():
    """The released package's groups hold no ``arithmetic``: loaded into the default
    ``arithmetic="paper"``, its run went on with Algorithm 1's steps (the residual scaled by alpha,
    the package's not), without a word. Loaded into ``arithmetic="released"``, no warning."""
    ref_model, our_model = _models(torch.float32)
    groups = dict(target_modules_list=TARGETS, rank=RANK, update_proj_gap=GAP, alpha=ALPHA)
    ref = fira.FiraAdamW(quiet_fira_divide_params(ref_model, **groups), lr=LR, no_deprecation_warning=True)
    for row in grad_sequence([tuple(p.shape) for p in ref_model.parameters()], 2, seed=3):
        _inject(ref_model, row)
        ref.step()
    paper = FiraAdamW(quiet_fira_divide_params(our_model, **groups), lr=LR)
    with pytest.warns(UserWarning, match=r"param group 1 was saved by the released fira package .* arithmetic='paper'"
                                         r".*build the optimizer with arithmetic='released'"):
        paper.load_state_dict(copy.deepcopy(ref.state_dict()))
    released = FiraAdamW(quiet_fira_divide_params(our_model, **groups), lr=LR, arithmetic="released")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        released.load_state_dict(copy.deepcopy(ref.state_dict()))


def test_a_released_run_continues_with_the_options_its_groups_set():
    """The released package's groups have no ``arithmetic`` (nor any other option of Fira's):
    options a group sets itself (``param_groups(model, arithmetic="released")`` sets them on the
    projected group) stay on it through the load. They were filled from the constructor's
    defaults, so the run went on with Algorithm 1's arithmetic, silently."""
    ref_model, our_model = _models(torch.float32)
    groups = dict(target_modules_list=TARGETS, rank=RANK, update_proj_gap=GAP, alpha=ALPHA)
    ref = fira.FiraAdamW(quiet_fira_divide_params(ref_model, **groups), lr=LR, eps=1e-8,
                         weight_decay=0.1, no_deprecation_warning=True)

    def ours_for():
        own = {"arithmetic": "released", "gamma": 1.01}  # set by each group, not the constructor
        released = [{**g, **own} for g in quiet_fira_divide_params(our_model, **groups)]
        return FiraAdamW(released, lr=LR, eps=1e-8, weight_decay=0.1, gamma=2.0)

    ours = _continued(ref_model, our_model, ref, ours_for)
    assert [g["arithmetic"] for g in ours.param_groups] == ["released", "released"]
    assert [g["gamma"] for g in ours.param_groups] == [1.01, 1.01]
