"""Hydra callbacks, registered in ``conf/hydra/default.yaml``.

``SweepStatus``: when a multirun ends, the jobs that did not complete, read from their ``summary.json`` (a job
killed outright has none), for ``train.py`` to list and, with ``fail_on_error=true``, to exit with status 1. From
the files, not from the jobs' return values: submitit's launchers run each job in a process of its own. A sweep
launched again into its directory (``hydra.sweep.dir``) counts only its own jobs (``src/report.py``'s
``load_sweep``).

``SweepReport``: when a multirun ends (every job done, on the machine that launched it, SLURM included), the
sweep's comparison is written into its directory as ``experiments/report.py`` writes it (``report.md``,
``report.png``) and the table is printed, so that ``python train.py -m memory=amp,accum`` ends with its runs
side by side. Turn it off with ``~hydra.callbacks.sweep_report``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from .errors import DataError

log = logging.getLogger(__name__)


@dataclass
class SweepOutcome:
    failed: list[str] | None = None  # the jobs that did not complete; None until a multirun has ended
    fail_on_error: bool = False


outcome = SweepOutcome()  # this process's last multirun


class SweepStatus(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        from .report import load_sweep

        try:
            jobs = load_sweep(config.hydra.sweep.dir, latest_launch=True)
        except DataError as e:  # no job wrote anything: every one of them failed to start
            outcome.failed = [str(e)]
        else:
            outcome.failed = [f"job {job.name} ({job.path}): {job.status or _no_summary(job)}"
                              + (": " + error.replace("\n", "\n      ")
                                 if (error := job.summary.get("error") or job.log_error) else "")
                              for job in jobs if job.status != "completed"]
        outcome.fail_on_error = bool(config.get("fail_on_error"))


def _no_summary(job) -> str:
    return "no summary.json of this launch" if job.earlier_summary else "no summary.json"


def write_sweep_report(sweep_dir: str) -> None:
    """The sweep's report.md and report.png, from the jobs of its latest launch; printed."""
    from .report import write_report  # matplotlib: imported once, at the end of a sweep

    try:
        md, png, table = write_report(sweep_dir, latest_launch=True)
    except Exception as e:  # the jobs' results stand without it; say why and how to retry
        log.warning("no sweep report (%s: %s); retry with python experiments/report.py %s",
                    type(e).__name__, e, sweep_dir)
        return
    print(f"\n{table}\nwrote {md} and {png}")


class SweepReport(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        write_sweep_report(config.hydra.sweep.dir)
