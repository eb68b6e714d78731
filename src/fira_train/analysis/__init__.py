"""The paper's analyses, each a ``fira-train analyze`` sub-command (:mod:`fira_train.analysis.cli`).

- :mod:`~fira_train.analysis.similarity`: low-rank vs full-rank scaling factors;
- :mod:`~fira_train.analysis.rank_sweep`: validation perplexity against the rank;
- :mod:`~fira_train.analysis.gap_sweep`: validation perplexity against the update gap T (not in
  the paper: it checks a recipe's T);
- :mod:`~fira_train.analysis.ablation`: scaling / limiter ablations and gamma;
- :mod:`~fira_train.analysis.spikes`: loss and gradient-norm spikes, GaLore vs GaLore-add;
- :mod:`~fira_train.analysis.noise`: robustness to gradient noise;
- :mod:`~fira_train.analysis.variance`: the Var[phi] simulation and Theorem 2 (no training).

The training analyses share :mod:`~fira_train.analysis.runs` (a list of runs trained by
:func:`fira_train.run.train.train`, report helpers) and :mod:`~fira_train.analysis.callbacks`.
Only the variance simulation is imported here (it needs numpy alone, no torch).
"""

from fira_train.analysis.variance import (
    VarianceCurves,
    check_theorem2,
    run_variance_analysis,
    simulate_scaling_variance,
)

__all__ = [
    "VarianceCurves",
    "check_theorem2",
    "run_variance_analysis",
    "simulate_scaling_variance",
]
