"""Where a run's figures go: ``metrics.jsonl`` in the run directory always, and W&B when ``logger=wandb``.

W&B is imported only when used, works offline (``mode: offline``, no account) and is always finished, with a
non-zero exit code when the run failed, so a sweep's dashboard shows which runs broke.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

log = logging.getLogger(__name__)


def _clean(value):
    """JSON has no NaN or infinity: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class RunLogger:
    def __init__(self, run_dir: Path, wandb_settings: dict | None = None, config: dict | None = None, name: str | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in finish)
        self.wandb = None
        if wandb_settings:
            self.wandb = self._start_wandb(wandb_settings, config or {}, name, Path(run_dir))

    @staticmethod
    def _start_wandb(settings: dict, config: dict, name: str | None, run_dir: Path):
        import wandb  # imported here: runs without logger=wandb do not need it

        mode = os.environ.get("WANDB_MODE") or settings.get("mode", "offline")
        return wandb.init(
            project=settings.get("project"),
            entity=settings.get("entity"),
            group=settings.get("group"),
            tags=list(settings.get("tags") or []),
            name=name,
            job_type="train",
            mode=mode,
            dir=str(run_dir),
            config=config,
            reinit="finish_previous",
        )

    def log(self, metrics: dict, step: int) -> None:
        row = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def finish(self, summary: dict) -> None:
        self._file.close()
        if self.wandb is not None:
            self.wandb.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float, str)) or v is None})
            self.wandb.finish(exit_code=0 if summary.get("status") == "completed" else 1)
            self.wandb = None
