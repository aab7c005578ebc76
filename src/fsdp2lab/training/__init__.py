"""The training loop and what it needs: optimizers, gradient clipping, metrics."""
