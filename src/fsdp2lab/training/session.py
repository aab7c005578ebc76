"""One training run on one rank: print the resolved config, train, and save the model if asked."""

from __future__ import annotations

from fsdp2lab.config import TrainConfig
from fsdp2lab.runtime.distributed import Runtime
from fsdp2lab.training.trainer import Trainer, log0


def run_training(cfg: TrainConfig, runtime: Runtime) -> dict:
    log0(runtime, "fsdp2lab: resolved config\n" + cfg.to_toml() + "\n")
    trainer = Trainer(cfg, runtime)
    summary = trainer.fit()
    if cfg.save_model:
        from fsdp2lab.checkpoint.export import save_full_model

        save_full_model(trainer.model, cfg.save_model, runtime)
        log0(runtime, f"fsdp2lab: model saved to {cfg.save_model}")
    return summary
