"""hydra-submitit-launcher's launchers, with a sweep that outlives a job killed outright.

submitit raises ``UncompletedJobError`` for a job that ended without a result (SIGKILL, the OOM killer, a lost
node) and ``FailedJobError`` for one that exited (``sys.exit`` after a SIGTERM); the plugin lets it out of
``launch``, so the sweep stopped with a traceback there, without its report or its list of failed jobs, while
later jobs could still be running. Here each job is waited for, and one without a result is logged and handed
to Hydra as a NaN, as ``train.py`` returns for a failed job; the sweep's status and report read every job's own
files (``src/callbacks.py``), where such a job shows with no ``summary.json`` of its own.

Used by ``hydra/launcher=slurm`` and ``hydra/launcher=local`` (conf/hydra/launcher/). Hydra takes launchers from
the ``hydra_plugins`` package only: hence this folder, beside ``src/``.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator, Sequence

from hydra.core.utils import JobReturn, JobStatus
from hydra_plugins.hydra_submitit_launcher import submitit_launcher

log = logging.getLogger(__name__)


@contextlib.contextmanager
def every_job_waited_for(results_timeout_s: float | None = None) -> Iterator[None]:
    """While launching: ``Job.results()`` of a job that ended without a result is a NaN, logged, not an error.

    ``results_timeout_s``: how long submitit waits for an ended job's result file to show before it calls the job
    one without a result (its own 15 s where None: a cluster's shared file system may show the file late)."""
    import submitit
    from submitit.core.utils import UncompletedJobError

    results, timeout = submitit.Job.results, submitit.Job._results_timeout_s
    if results_timeout_s is not None:
        submitit.Job._results_timeout_s = results_timeout_s

    def results_or_nan(job: submitit.Job) -> list:
        try:
            return results(job)
        except UncompletedJobError as e:  # and FailedJobError, its subclass
            reason = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
            log.error("job %s ended without a result: %s (its logs: %s)", job.job_id, reason, job.paths.folder)
            return [JobReturn(status=JobStatus.COMPLETED, _return_value=math.nan)]

    submitit.Job.results = results_or_nan
    try:
        yield
    finally:
        submitit.Job.results, submitit.Job._results_timeout_s = results, timeout


class _WaitsForEveryJob:
    def _waiting(self) -> contextlib.AbstractContextManager:
        return every_job_waited_for()

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        with self._waiting():
            return super().launch(job_overrides, initial_job_idx)


class SlurmLauncher(_WaitsForEveryJob, submitit_launcher.SlurmLauncher):
    pass


class LocalLauncher(_WaitsForEveryJob, submitit_launcher.LocalLauncher):
    def _waiting(self) -> contextlib.AbstractContextManager:
        # A local job is a process of this host, done when it has exited: by then its result file is written, or
        # it never will be (killed), so waiting 15 s for the file to show is waiting for nothing.
        return every_job_waited_for(results_timeout_s=1)
