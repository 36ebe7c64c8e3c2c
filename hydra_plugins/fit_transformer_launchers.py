"""hydra-submitit-launcher's launchers, with a sweep that outlives a job killed outright.

submitit raises ``UncompletedJobError`` for a job that ended without a result (SIGKILL, the OOM killer, a lost
node) and ``FailedJobError`` for one that exited (``sys.exit`` after a SIGTERM); the plugin lets it out of
``launch``, so the sweep stopped with a traceback there, without its report or its list of failed jobs, while
later jobs could still be running. Here each job is waited for, and one without a result is logged and handed
to Hydra as a NaN, as ``train.py`` returns for a failed job; the sweep's status and report read every job's own
files (``src/callbacks.py``), where such a job shows with no ``summary.json`` of its own.

``hydra/launcher=local`` gives each job GPUs of its own (``gpus_per_node`` of them, on a machine with GPUs) and
cores of its own (``cpus_per_task`` a task; all of them, one job at a time, on a machine without GPUs where that is
not given), as many jobs at a time as these allow, the next job starting where the first to end ran: submitit's
local executor showed every job GPU 0 and started them all at once, side by side on one card or on the same cores.

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
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple, TypeVar

from hydra.core.utils import JobReturn, JobStatus
from hydra_plugins.hydra_submitit_launcher import submitit_launcher

log = logging.getLogger(__name__)
S, T = TypeVar("S"), TypeVar("T")


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


def cut(items: Sequence, per_job: int) -> list[tuple]:
    """``items`` cut into slots of ``per_job`` each (those left over from the last whole slot are not used); none
    where a job takes none or more than there are."""
    if per_job < 1:
        return []
    return [tuple(items[i:i + per_job]) for i in range(0, len(items) - per_job + 1, per_job)]


class Slot(NamedTuple):  # (not a dataclass: Hydra's plugin scan runs this module outside sys.modules)
    """What one job of a local sweep runs on: its GPUs (``CUDA_VISIBLE_DEVICES``; empty: none, on a machine that
    shows none; None: not divided) and its cores (``cpus_per_task`` for each of its tasks in turn; none: not
    divided)."""

    gpus: str | None = None
    cpus: tuple[int, ...] = ()

    def __str__(self) -> str:
        from src.environment import core_list

        return ", ".join([*([f"GPU(s) {self.gpus}"] if self.gpus else []),
                          *([f"cores {core_list(self.cpus)}"] if self.cpus else [])])


def job_slots(gpus: Sequence[str], gpus_per_job: int, cpus: Sequence[int], cpus_per_job: int) -> list[Slot]:
    """A slot for each job that may run at once: ``gpus_per_job`` of the GPUs (where the machine shows any) and
    ``cpus_per_job`` of the cores (where given), as many slots as both allow. Where neither is divided (no GPUs and
    no cores a job), one slot of all the cores: one job at a time, as the default launcher runs them (all at once,
    each with a thread per core, two jobs took 3.3x as long on 2 cores: README, More than one GPU). On a machine
    that shows no GPUs, every slot's are none (submitit's executor would show each job the ``gpus_per_node``
    GPUs it was asked for, which are not there, and the job's summary would record them)."""
    by_gpus = [",".join(g) for g in cut(gpus, gpus_per_job)] if gpus and gpus_per_job else None
    by_cpus = cut(cpus, cpus_per_job) if cpus_per_job else None
    if by_gpus is None and by_cpus is None:
        by_cpus = [tuple(cpus)]
    n = min(len(slots) for slots in (by_gpus, by_cpus) if slots is not None)
    undivided = None if gpus else ""
    return [Slot(by_gpus[i] if by_gpus is not None else undivided, by_cpus[i] if by_cpus is not None else ())
            for i in range(n)]


def run_on_cores(cores: Sequence[int]) -> None:
    """This process (and the processes it starts) on ``cores`` alone, with a thread per core (fewer where
    ``OMP_NUM_THREADS`` asks for fewer): PyTorch's, and ``OMP_NUM_THREADS`` for the processes started later, a count
    the run then keeps (``src.distributed.shared_cores_tasks``)."""
    import torch

    asked = os.environ.get("OMP_NUM_THREADS", "")
    threads = min(len(cores), int(asked)) if asked.isdigit() and int(asked) > 0 else len(cores)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if hasattr(os, "sched_setaffinity"):  # (macOS has none: there the threads alone)
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(threads)


def run_in_slots(slots: Sequence[S], jobs: int, run: Callable[[S, int], T]) -> list[T]:
    """``[run(slot, i) for i in range(jobs)]``, as many at a time as there are ``slots``, each call given a slot no
    running call holds: job i starts, in order, as soon as any slot is free, not once a whole batch has ended. If
    the caller is stopped (Ctrl-C), the jobs not yet started never start; those running are waited for.

    A thread a slot, all started before the first job, each running the jobs handed to it one by one from the
    caller's thread, which waits for a slot in between: Python runs a signal's handler in that thread, and a
    thread blocked waiting may run it only once woken, as a job ends (measured: 1 s late, 1 time in 22 on a loaded
    machine); the stop then comes before the next job is handed the freed slot. (Queued in a pool instead, the
    next job was taken by the freed thread first. And a pool starts its threads as jobs come: a stop raised in
    the caller while it started the thread of a job already running left that thread unknown to the pool, which
    returned without waiting for its job: 272 times in 600 with 2 cores kept busy by other processes.)"""
    results: list = [None] * jobs
    ended: queue.SimpleQueue[tuple[queue.SimpleQueue, BaseException | None]] = queue.SimpleQueue()

    def slot_thread(slot: S, inbox: queue.SimpleQueue) -> None:
        while (i := inbox.get()) is not None:
            try:
                results[i] = run(slot, i)
            except BaseException as e:  # handed to the caller, which starts no job after it
                ended.put((inbox, e))
            else:
                ended.put((inbox, None))

    threads: list[tuple[threading.Thread, queue.SimpleQueue]] = []
    try:
        for n, slot in enumerate(slots):
            inbox: queue.SimpleQueue = queue.SimpleQueue()
            thread = threading.Thread(target=slot_thread, args=(slot, inbox), name=f"job-slot-{n}")
            threads.append((thread, inbox))  # before it starts: a stop raised in start() still ends it
            thread.start()
        free = [inbox for _, inbox in threads]
        for i in range(jobs):
            if not free:
                free.append(slot_freed(ended))
            free.pop(0).put(i)
        while len(free) < len(threads):
            free.append(slot_freed(ended))
    finally:  # the running jobs end, and no other starts: each thread's next job is the end
        for _, inbox in threads:
            inbox.put(None)
        for thread, _ in threads:
            if thread.is_alive():
                thread.join()
    return results


def slot_freed(ended: queue.SimpleQueue) -> queue.SimpleQueue:
    """The inbox of the first slot whose job ends from now (or has ended unseen); that job's exception raised."""
    inbox, error = ended.get()
    if error is not None:
        raise error
    return inbox


class _FirstTimeOnly(logging.Filter):
    """Lets each message through once."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        first = message not in self.seen
        self.seen.add(message)
        return first


class LocalLauncher(_WaitsForEveryJob, submitit_launcher.LocalLauncher):
    slot: Slot = Slot()  # the GPUs and cores of the job this launcher is a copy for (launch)

    def _waiting(self) -> contextlib.AbstractContextManager:
        # A local job is a process of this host, done when it has exited: by then its result file is written, or
        # it never will be (killed), so waiting 15 s for the file to show is waiting for nothing.
        return every_job_waited_for(results_timeout_s=1)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        """As many jobs at a time as there are slots (``job_slots``: of ``gpus_per_node`` GPUs, of ``cpus_per_task``
        cores a task, or of all the cores), each job on a slot of its own, so that its tokens/s and peak memory are
        its own; the next job starts on the slot of the first to end. Without a slot for even one job (more GPUs
        a job than the machine shows): every job at once, as submitit starts them."""
        from src.environment import usable_cores

        params = self.params
        slots = job_slots(visible_gpus(), params.get("gpus_per_node") or 0, usable_cores(),
                          (params.get("cpus_per_task") or 0) * (params.get("tasks_per_node") or 1))
        if not slots:
            return super().launch(job_overrides, initial_job_idx)
        log.info("%d job(s), %d at a time, each on its own: %s", len(job_overrides), len(slots),
                 " | ".join(map(str, slots)))

        def run(slot: Slot, i: int) -> JobReturn:
            job = copy.copy(self)  # submitit pickles the launcher into the job: this copy carries the job's slot
            job.slot = slot
            log.info("#%d on %s", initial_job_idx + i, slot)
            return submitit_launcher.LocalLauncher.launch(job, [job_overrides[i]], initial_job_idx + i)[0]

        once = _FirstTimeOnly()  # the plugin's launch, run for each job, logs the sweep's directory each time
        submitit_launcher.log.addFilter(once)
        try:
            with self._waiting():  # once for all the jobs: it patches submitit.Job
                return run_in_slots(slots, len(job_overrides), run)
        finally:
            submitit_launcher.log.removeFilter(once)

    def __call__(self, sweep_overrides, job_dir_key, job_num, job_id, singleton_state):
        """In the job's process (each task's), before anything there starts CUDA: the job's own GPUs (none
        on a machine without), not submitit's 0 .. gpus_per_node - 1 for every job, and the task's own cores."""
        if self.slot.gpus is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = self.slot.gpus
        if self.slot.cpus:
            tasks = int(os.environ.get("SUBMITIT_LOCAL_NTASKS", "1"))
            task = int(os.environ.get("SUBMITIT_LOCAL_LOCALID", "0"))
            per_task = max(1, len(self.slot.cpus) // tasks)
            run_on_cores(self.slot.cpus[task * per_task:(task + 1) * per_task] or self.slot.cpus)
        return super().__call__(sweep_overrides, job_dir_key, job_num, job_id, singleton_state)
