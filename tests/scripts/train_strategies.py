"""Run under torchrun: train several strategies one after another in the same ranks (what
``fsdp2lab train`` runs on each rank, without starting the processes again for each).

    train_strategies.py OUT_DIR '{"ddp": ["--strategy", "ddp"], ...}' COMMON_FLAGS...

Each variant writes OUT_DIR/<name>.jsonl, as ``fsdp2lab train --metrics-file`` does.
"""

import argparse
import json
import sys
from pathlib import Path

from fsdp2lab.config import add_train_arguments, config_from_args
from fsdp2lab.runtime import distributed, launch_env
from fsdp2lab.training.session import run_training


def main() -> None:
    out, variants, common = Path(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3:]
    runtime = distributed.init(launch_env.detect(), "cpu")
    try:
        for name, flags in variants.items():
            parser = argparse.ArgumentParser()
            add_train_arguments(parser)
            metrics = ["--metrics-file", str(out / f"{name}.jsonl")]
            cfg = config_from_args(parser.parse_args([*common, *flags, *metrics]))
            run_training(cfg, runtime)
    finally:
        distributed.destroy()


if __name__ == "__main__":
    main()
    distributed.exit_process(0)
