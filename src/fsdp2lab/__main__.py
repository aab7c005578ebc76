"""``python -m fsdp2lab`` (the form torchrun uses: ``torchrun ... -m fsdp2lab train``)."""

from fsdp2lab.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
