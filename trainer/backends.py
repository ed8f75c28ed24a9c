"""Which trainer backend runs the steps: the one place that chooses.

    trainer = open_trainer(model_dir, config, collective=distributed.from_env())

`config.backend` names it: 'peft' (`trainer.peft_backend.PeftTrainer`, CPU or CUDA) or
'unsloth' (`trainer.unsloth_backend.UnslothTrainer`, imported only here and only when asked
for, as Unsloth is installed only in the GPU trainer image). The data-parallel collectives
(`trainer.distributed`), when there are several ranks, are handed to the trainer here.

The modules stand on each other in one direction: `distributed` (collectives) <- `peft_backend`
<- `unsloth_backend` <- this module.
"""

from __future__ import annotations

from pathlib import Path

from trainer.config import TrainerConfig
from trainer.distributed import Collective
from trainer.peft_backend import PeftTrainer


def open_trainer(
    model_dir: Path,
    config: TrainerConfig,
    *,
    device: str | None = None,
    collective: Collective | None = None,
) -> PeftTrainer:
    """The trainer of `config.backend` on `model_dir`, joined to `collective` (None: one
    process)."""
    if config.backend == "unsloth":
        from trainer.unsloth_backend import UnslothTrainer

        return UnslothTrainer(model_dir, config, device=device, collective=collective)
    return PeftTrainer(model_dir, config, device=device, collective=collective)
