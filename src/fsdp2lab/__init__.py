"""fsdp2lab: train PyTorch models with FSDP2 on a DeviceMesh, from a laptop CPU to a Slurm cluster."""

__version__ = "0.1.0"
