"""Legacy APIs run beside FSDP2 for comparison and migration (``--strategy fsdp1``)."""
