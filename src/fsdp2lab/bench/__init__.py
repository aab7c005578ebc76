"""Benchmark sweeps (``fsdp2lab bench``) and their report (``fsdp2lab report``)."""
