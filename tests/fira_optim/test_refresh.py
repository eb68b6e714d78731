"""Stage 1's refresh rule: which bases are due, and the random projector's seeds."""

import torch

from fira_optim.options import Projector
from fira_optim.projection import LEFT
from fira_optim.refresh import new_basis, refresh_due, refresh_seed


def test_no_two_matrices_of_a_staggered_run_draw_the_same_random_basis() -> None:
    """The seed was a linear mix of the group seed, the matrix's index and the step: under
    stagger the second matrix refreshing at step 39600 drew the same basis as the seventh at
    step 5 (224 matrices, T = 200: the matrices of a 7B LLaMA)."""
    group = {"seed": 0, "projector": Projector.RANDOM.value, "align_signs": False, "update_proj_gap": 200,
             "stagger": True}
    grad = torch.randn(16, 24, generator=torch.Generator().manual_seed(0))
    assert refresh_due(group, 39600, 1, 224) and refresh_due(group, 5, 6, 224)
    first = new_basis(grad, 4, LEFT, group, None, 1, 39600, "a")
    second = new_basis(grad, 4, LEFT, group, None, 6, 5, "b")
    assert not torch.allclose(first, second)
    seeds = {refresh_seed(0, order, step) for order in range(224) for step in range(0, 150_000, 997)}
    assert len(seeds) == 224 * len(range(0, 150_000, 997))
    assert all(0 <= seed < 2**63 for seed in seeds)


def test_the_seed_is_a_function_of_the_group_seed_the_matrix_and_the_step() -> None:
    """Resuming is exact: the same three give the same basis in any process."""
    group = {"seed": -3, "projector": Projector.RANDOM.value, "align_signs": False}
    grad = torch.randn(10, 6, generator=torch.Generator().manual_seed(1))
    assert torch.equal(new_basis(grad, 2, LEFT, group, None, 4, 12, "a"), new_basis(grad, 2, LEFT, group, None, 4, 12, "a"))
    assert refresh_seed(-3, 4, 12) != refresh_seed(3, 4, 12) != refresh_seed(-3, 12, 4)
