"""Runtime: how this process was launched, its device and process group, and the DeviceMesh."""
