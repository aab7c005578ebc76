"""Planning at scale without the hardware: ``fsdp2lab plan``.

:mod:`.simulate` runs the real parallelize code and training steps on fake tensors over a fake
process group of any world size; :mod:`.gpus` is the table of accelerators; :mod:`.estimate`
turns what a simulation measured into memory, communication and time on a GPU; :mod:`.report`
prints it. Not to be confused with :mod:`fsdp2lab.plan`, the run plan every command resolves.
"""
