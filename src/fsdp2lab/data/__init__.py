"""Data: datasets held as tensors, a world-size-independent distributed sampler, and the loaders."""
