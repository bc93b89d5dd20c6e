"""Attention diagnostics: capture hooks, pure metric functions, gradient-norm statistics, plots."""
