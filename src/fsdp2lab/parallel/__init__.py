"""Parallelisms: each strategy is one function ``parallelize(model, mesh, cfg) -> model``."""
