"""Hydra callbacks, registered in ``conf/hydra/default.yaml``.

``SweepReport``: when a multirun ends (every job done, on the machine that launched it, SLURM included), the
sweep's comparison is written into its directory as ``experiments/report.py`` writes it (``report.md``,
``report.png``) and the table is printed, so that ``python train.py -m memory=amp,accum`` ends with its runs
side by side. Turn it off with ``~hydra.callbacks.sweep_report``.
"""

from __future__ import annotations

import logging

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

log = logging.getLogger(__name__)


class SweepReport(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        from .report import write_report  # matplotlib: imported once, at the end of a sweep

        sweep_dir = config.hydra.sweep.dir
        try:
            md, png, table = write_report(sweep_dir)
        except Exception as e:  # the jobs' results stand without it; say why and how to retry
            log.warning("no sweep report (%s: %s); retry with python experiments/report.py %s",
                        type(e).__name__, e, sweep_dir)
            return
        print(f"\n{table}\nwrote {md} and {png}")
