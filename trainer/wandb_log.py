"""Optional: each training step's metrics to Weights & Biases, when `WANDB_PROJECT` is set.

    hook = WandbLog.from_env(config={...}, policy="rlproxy")   # None without WANDB_PROJECT
    loop = TrainingLoop(..., step_hooks=[hook] if hook else [])
    ...
    hook.close()

One W&B run per trainer process; each step is logged at `step = version`, so a restarted trainer
continues the same x axis in a new run. Everything else is W&B's own environment: `WANDB_ENTITY`,
`WANDB_MODE=offline` (write runs under `WANDB_DIR` and `wandb sync` them later),
`WANDB_RUN_GROUP`, `WANDB_API_KEY`. `wandb` is an optional extra (`pip install
'rlproxy[wandb]'`); without it, or when W&B refuses to start, training goes on without logging
and the reason is logged as an error.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from trainer.loop import StepReport

logger = logging.getLogger(__name__)

PROJECT_ENV = "WANDB_PROJECT"


class WandbLog:
    """A step hook for `trainer.loop.TrainingLoop` that logs to one W&B run."""

    def __init__(self, run: Any) -> None:
        self.run = run

    @classmethod
    def from_env(cls, config: dict[str, Any], policy: str) -> WandbLog | None:
        """A run in `$WANDB_PROJECT`; None when it is unset, wandb is missing or won't start."""
        project = os.environ.get(PROJECT_ENV)
        if not project:
            return None
        try:
            import wandb
        except ImportError:
            logger.error(
                "%s is set but wandb is not installed (pip install 'rlproxy[wandb]'); "
                "training without W&B logging",
                PROJECT_ENV,
            )
            return None
        try:
            run = wandb.init(project=project, job_type="train", config={**config, "policy": policy})
        except Exception as exc:  # no API key, no network: training must not stop for it
            logger.error("W&B did not start (%s); training without W&B logging", exc)
            return None
        logger.info("logging training steps to W&B project %s (run %s)", project, run.id)
        return cls(run)

    def __call__(self, report: StepReport) -> None:
        numbers = {
            f"train/{k}": float(v)
            for k, v in report.metrics.items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        }
        self.run.log({**numbers, "train/version": report.version}, step=report.version)

    def close(self) -> None:
        self.run.finish()
