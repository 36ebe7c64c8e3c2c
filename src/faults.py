"""Faults and signals: failures injected on purpose (``fault.*``), SIGINT/SIGTERM that stop a run after a whole
step, and the SLURM/submitit requeue that resumes it."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import ConfigError, check_int
from .state import step_checkpoints

if TYPE_CHECKING:
    from .trainer import Trainer

log = logging.getLogger(__name__)


def check_fault(fault: dict) -> None:
    """The fault group's settings, each mistake one line naming its key (``settings.check_settings``)."""
    kind, kinds = fault.get("kind"), Fault.KINDS
    if kind is not None and kind not in kinds:
        raise ConfigError(f"fault.kind={kind}: expected null, {', '.join(kinds[:-1])} or {kinds[-1]}")
    check_int("fault.at_step", fault.get("at_step", 1), 1)
    check_int("fault.times", fault.get("times", 1), 0)
    check_int("fault.rank", fault.get("rank"), 0, nullable=True)
    given = [f"fault.{k}={fault[k]}" for k, default in (("at_step", 1), ("times", 1), ("rank", None))
             if fault.get(k, default) != default]
    if kind is None and given:
        log.warning("%s without fault.kind: nothing is injected (fault.kind=%s)", " ".join(given), "|".join(kinds))


class Fault:
    """``fault.kind`` raised at optimizer step ``fault.at_step``: how tests (and a curious user) check that a
    failure mid-run, on any device, is recorded and handled as a real one would be."""

    KINDS = ("oom", "oom_update", "error", "nan_loss", "sigterm", "sigusr2", "kill")
    SIGNALS = {"sigterm": signal.SIGTERM, "sigusr2": signal.SIGUSR2, "kill": signal.SIGKILL}

    def __init__(self, kind: str | None = None, at_step: int = 1, times: int = 1):  # (checked by check_fault)
        self.kind, self.at_step, self.times = kind, at_step, times

    def maybe_raise(self, step: int, trainer: Trainer | None = None) -> None:
        """Act on the first ``times`` attempts at step ``at_step`` (a step redone after a back-off is another
        attempt): raise ``error``, make the step run out of memory in its first forward pass (``oom``) or in its
        update (``oom_update``), or its loss NaN (``nan_loss``), or
        send this process SIGTERM (``sigterm``: a preemption, handled after the step), SIGUSR2 (``sigusr2``:
        submitit's requeue signal) or SIGKILL (``kill``: a crash, nothing handled)."""
        if self.kind is None or step != self.at_step or self.times <= 0:
            return
        self.times -= 1
        where = f"(fault injected at step {step} by fault.kind={self.kind})"
        if self.kind == "oom":  # raised by the trainer at the step's first forward pass, as a real one would be
            trainer.inject_oom = f"CUDA out of memory. Tried to allocate 1.91 GiB {where}"
        elif self.kind == "oom_update":  # at the step's update, after backward (Adam's first step making its state)
            trainer.inject_oom_update = f"CUDA out of memory. Tried to allocate 256.00 MiB {where}"
        elif self.kind == "nan_loss":
            trainer.inject_nonfinite = True
        elif self.kind in self.SIGNALS:
            os.kill(os.getpid(), self.SIGNALS[self.kind])
        else:
            raise RuntimeError(f"injected failure {where}")


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived: the run stopped after a whole step and wrote a checkpoint to resume from."""

    def __init__(self, signum: int, step: int, where: str = "in the same run directory"):
        super().__init__(f"{signal.Signals(signum).name} at step {step}: checkpoint written; continue with "
                         f"trainer.resume=auto {where}")
        self.signum = signum


def continue_where(job: dict, run_dir: Path) -> str:
    """The setting that points a run started again at the run directory a stopped run left: the sweep's, for a
    sweep's job (its default directory is named by the time it started), else the run's."""
    if job.get("sweep_dir"):
        return f"and hydra.sweep.dir={job['sweep_dir']} (the same sweep command: its jobs resume, or start)"
    return f"and hydra.run.dir={run_dir}" if job else f"in {run_dir}"


@contextlib.contextmanager
def stop_on_signals():
    """While training: SIGINT and SIGTERM (a SLURM preemption) ask the loop to stop after the current step; a
    second SIGINT stops at once. Only in the main thread, where Python delivers signals."""
    flag = type("Stop", (), {"signum": None})()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def handler(signum, frame):
        if flag.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        flag.signum = signum
        log.warning("%s received: stopping after this step", signal.Signals(signum).name)

    # SIGUSR2 too where a handler listens for it: submitit's, which requeues a SLURM job before its time limit or
    # on preemption. The run checkpoints first; train.py then hands the signal on (pass_on_signal).
    listened = [s for s in (signal.SIGUSR1, signal.SIGUSR2) if callable(signal.getsignal(s))]
    signals = [signal.SIGINT, signal.SIGTERM, *listened]
    previous = {s: signal.signal(s, handler) for s in signals}
    try:
        yield flag
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def pass_on_signal(signum: int) -> None:
    """After an interrupted run wrote its checkpoint: SIGUSR1/SIGUSR2 go to the handler that listened before the
    run (submitit requeues the job, which then resumes); nothing to do for the others."""
    previous = signal.getsignal(signum)
    if signum in (signal.SIGUSR1, signal.SIGUSR2) and callable(previous):
        previous(signum, None)


def resume_setting(tr: dict, ckpt_dir: Path) -> str | None:
    """trainer.resume, or ``auto`` for a requeued job (after a preemption or a time limit), which continues from
    its own newest checkpoint: one that SLURM restarted (SLURM_RESTART_COUNT > 0), whatever trainer.resume it was
    started with (``never`` starts its first attempt over, not every attempt), or, unless trainer.resume says
    otherwise, a submitit job whose run directory already holds checkpoints (a sweep's jobs start in fresh
    directories, so only a requeue finds them)."""
    restarts = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    submitit = tr.get("resume") is None and os.environ.get("SUBMITIT_EXECUTOR") and step_checkpoints(ckpt_dir)
    if restarts or submitit:
        log.info("a requeued job (%s): resuming from its newest checkpoint",
                 f"SLURM_RESTART_COUNT={restarts}" if restarts else "submitit, checkpoints in its run directory")
        return "auto"
    return tr.get("resume")


def fault_settings(conf: dict, rank: int) -> dict:
    fault = conf.get("fault") or {}
    targeted = fault.get("rank") is None or fault["rank"] == rank  # torchrun: fault.rank alone fails, if set
    return {"kind": fault.get("kind") if targeted else None, "at_step": fault.get("at_step", 1),
            "times": fault.get("times", 1)}
