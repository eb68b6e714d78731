"""Numerical analyses behind the paper's theory appendix (simulations, no training)."""

from .variance import (
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
