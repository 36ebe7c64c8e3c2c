"""hydra-submitit-launcher's launchers, with a sweep that outlives a job killed outright.

submitit raises ``UncompletedJobError`` for a job that ended without a result (SIGKILL, the OOM killer, a lost
node) and ``FailedJobError`` for one that exited (``sys.exit`` after a SIGTERM); the plugin lets it out of
``launch``, so the sweep stopped with a traceback there, without its report or its list of failed jobs, while
later jobs could still be running. Here each job is waited for, and one without a result is logged and handed
to Hydra as a NaN, as ``train.py`` returns for a failed job; the sweep's status and report read every job's own
files (``src/callbacks.py``), where such a job shows with no ``summary.json`` of its own.

On a machine with GPUs, ``hydra/launcher=local`` gives each job GPUs of its own (``gpus_per_node`` of them), as many
jobs at a time as the GPUs allow, the next job starting on the GPUs of the first to end: submitit's local executor
showed every job GPU 0 and started them all at once, side by side on one card.

Used by ``hydra/launcher=slurm`` and ``hydra/launcher=local`` (conf/hydra/launcher/). Hydra takes launchers from
the ``hydra_plugins`` package only: hence this folder, beside ``src/``.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import queue
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from hydra.core.utils import JobReturn, JobStatus
from hydra_plugins.hydra_submitit_launcher import submitit_launcher

log = logging.getLogger(__name__)
T = TypeVar("T")


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


def visible_gpus() -> list[str]:
    """The GPUs this process may use: ``CUDA_VISIBLE_DEVICES``'s list where it is set (indices or UUIDs; empty:
    none), else every GPU the driver counts."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        return [gpu.strip() for gpu in given.split(",") if gpu.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def gpu_slots(gpus: Sequence[str], per_job: int) -> list[str]:
    """``gpus`` cut into the ``CUDA_VISIBLE_DEVICES`` of jobs of ``per_job`` GPUs each (the GPUs left over from
    the last whole slot are not used); none where a job takes no GPU or more than there are."""
    if per_job < 1:
        return []
    return [",".join(gpus[i:i + per_job]) for i in range(0, len(gpus) - per_job + 1, per_job)]


def run_in_slots(slots: Sequence[str], jobs: int, run: Callable[[str, int], T]) -> list[T]:
    """``[run(slot, i) for i in range(jobs)]``, as many at a time as there are ``slots``, each call given a slot no
    running call holds: job i starts, in order, as soon as any slot is free, not once a whole batch has ended. If
    the caller is stopped (Ctrl-C), the jobs not yet started never start; those running are waited for."""
    free: queue.SimpleQueue[str] = queue.SimpleQueue()
    for slot in slots:
        free.put(slot)

    def one(i: int) -> T:
        slot = free.get()  # never waits: no more calls run at once than there are slots
        try:
            return run(slot, i)
        finally:
            free.put(slot)

    with ThreadPoolExecutor(max_workers=len(slots), thread_name_prefix="gpu-slot") as pool:
        return list(pool.map(one, range(jobs)))  # map's iterator, stopped, cancels the jobs not yet started


class LocalLauncher(_WaitsForEveryJob, submitit_launcher.LocalLauncher):
    slot: str | None = None  # the GPUs of the job this launcher is a copy for (launch)

    def _waiting(self) -> contextlib.AbstractContextManager:
        # A local job is a process of this host, done when it has exited: by then its result file is written, or
        # it never will be (killed), so waiting 15 s for the file to show is waiting for nothing.
        return every_job_waited_for(results_timeout_s=1)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        """With GPUs for at least one job: as many jobs at a time as there are slots of ``gpus_per_node`` GPUs, each
        on a slot of its own (a job's tokens/s and peak memory are then its own), the next job starting on the slot
        of the first to end. Without (a CPU machine, or gpus_per_node=0): every job at once, as submitit starts
        them."""
        slots = gpu_slots(visible_gpus(), self.params.get("gpus_per_node") or 0)
        if not slots:
            return super().launch(job_overrides, initial_job_idx)
        log.info("%d job(s), %d at a time, each on GPU(s) of its own: %s", len(job_overrides), len(slots),
                 " | ".join(slots))

        def run(slot: str, i: int) -> JobReturn:
            job = copy.copy(self)  # submitit pickles the launcher into the job: this copy carries the job's GPUs
            job.slot = slot
            log.info("#%d on GPU(s) %s", initial_job_idx + i, slot)
            return submitit_launcher.LocalLauncher.launch(job, [job_overrides[i]], initial_job_idx + i)[0]

        with self._waiting():  # once for all the jobs: it patches submitit.Job
            return run_in_slots(slots, len(job_overrides), run)

    def __call__(self, sweep_overrides, job_dir_key, job_num, job_id, singleton_state):
        """In the job's process (each task's), before anything there starts CUDA: the job's own GPUs, not
        submitit's 0 .. gpus_per_node - 1 for every job."""
        if self.slot is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = self.slot
        return super().__call__(sweep_overrides, job_dir_key, job_num, job_id, singleton_state)
