"""Checkpoints: distributed (DCP) save and resume, and plain state-dict export."""
