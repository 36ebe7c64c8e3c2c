"""Train and evaluate a Transformer translation model: `python train.py [group=option ...] [key=value ...]`.

A sweep: `python train.py -m memory=none,amp,accum`. See README.md and conf/train.yaml.

In a sweep, a job that fails (a bad setting, an error, out of memory) is recorded as failed in its summary.json
and W&B run, and the next job starts; the sweep exits with status 1 at the end only with `fail_on_error=true`.
A single run that fails exits with status 1.
"""

import logging
import math
import os
import signal
import sys
from typing import NoReturn

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from src import callbacks as sweep
from src.config_check import check_command_line, check_launcher, preset_sweep_note, with_project_hydra
from src.errors import UserError, error_lines

log = logging.getLogger("train")


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float:
    # torch and the run's modules are imported here, once a run begins: --help, --cfg and a mistyped override are
    # answered without them (in 0.4-0.8 s rather than 2)
    from src.distributed import world_from_env
    from src.run import train

    multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    if not world_from_env().main:  # a submitit job's later tasks, to which Hydra gave the job's log file (and
        quiet_logging()  # torchrun's, quiet already: quiet_rank)
    try:
        summary = train(cfg)
    except KeyboardInterrupt as e:  # SIGINT / SIGTERM / SIGUSR2: a checkpoint was written (summary: interrupted)
        interrupted(e, multirun)
    except Exception as e:  # summary.json and the W&B run already record it
        return failed(e, multirun)
    if "test_bleu" not in summary:  # torchrun: ranks other than 0 neither evaluate nor print
        return math.nan
    print(final_line(summary, cfg.paths.output_dir))
    return summary["valid_bleu"]  # the value a Hydra sweeper (e.g. Optuna) maximizes


def interrupted(e: KeyboardInterrupt, multirun: bool) -> NoReturn:
    """A run stopped by a signal: said, a sweep run in this process reported, the signal passed on, and the
    process ended with the signal's exit status."""
    from src.faults import pass_on_signal

    log.error("interrupted: %s", str(e) or "SIGINT, stopped at once (before training or a second SIGINT): no "
              "checkpoint written for this stop")
    signum = getattr(e, "signum", signal.SIGINT)
    hydra_cfg = HydraConfig.get()
    if multirun and hydra_cfg.launcher._target_.endswith(".BasicLauncher") and "sweep_report" in hydra_cfg.callbacks:
        # The sweep's jobs run in this process, so the signal stops the sweep, and its end-of-sweep callbacks
        # will not run: the report of the jobs it ran, this one interrupted. (A job of submitit's launchers is
        # a process of its own: the sweep goes on, and reports at its end.)
        log.error("sweep stopped at job %s; its report holds the jobs it ran", hydra_cfg.job.num)
        sweep.write_sweep_report(hydra_cfg.sweep.dir)
    pass_on_signal(signum)  # submitit's SIGUSR2: it requeues the SLURM job, which resumes
    sys.exit(128 + signum)


def failed(e: Exception, multirun: bool) -> float:
    """A run that failed: a user's mistake in one line each (and out of memory, which src/run.py said), the process
    ended with status 1 (a traceback for anything else); in a sweep, NaN, and the next job starts."""
    import torch  # (imported by src.run already)

    if isinstance(e, UserError):
        for problem in str(e).splitlines():  # one line each, naming the key, file or line
            log.error("error: %s", problem)
    # out of memory after the back-offs: src/run.py logged its one line (the sizes tried, the memory snapshot)
    told = isinstance(e, (UserError, torch.OutOfMemoryError))
    if told and log.disabled:  # hydra/job_logging=disabled: the run's loggers are off, its error still shows
        print(error_lines(e) if isinstance(e, UserError) else f"error: {str(e).splitlines()[0]}", file=sys.stderr)
    if not multirun:
        if told:
            sys.exit(1)
        raise  # (the exception being handled, in main)
    if not told:
        log.error("job failed", exc_info=e)
    return math.nan  # a failed trial, to a sweeper that optimizes the returned value (and the next job starts)


def final_line(summary: dict, output_dir: str) -> str:
    """The line a completed run ends with: its label, scores, speed, peak and directory."""
    peak = summary["peak_memory_mb"]
    backed_off = (f" (backed off to accum_steps {summary['final_accum_steps']})" if summary.get("oom_backoffs")
                  else "")  # out of memory: the rest of the run trained in smaller micro-batches
    return (f"[{summary['strategy']}]{backed_off} {scores(summary)}, {summary['tokens_per_s']:.0f} tokens/s, "
            f"peak memory {'not tracked' if peak is None else f'{peak} MiB'} -> {output_dir}")


def scores(summary: dict) -> str:
    """The run's BLEU, saying what it was measured on where that is not the whole test set."""
    from src.report import evaluated_on

    scope = evaluated_on(summary)
    if summary.get("overfit_batches"):
        return f"BLEU {summary['test_bleu']:.2f} {scope}"
    return f"test BLEU {summary['test_bleu']:.2f} (valid {summary['valid_bleu']:.2f})" + (f" {scope}" if scope else "")


def quiet_rank(argv: list[str]) -> list[str]:
    """torchrun: ranks other than 0 run in the current directory without Hydra's output files or log file, and log
    only their errors, to stderr (rank 0's run directory is shared with them once the process group is up:
    src/run.py)."""
    if os.environ.get("RANK", "0") == "0":
        return argv
    if any(a in ("-m", "--multirun") for a in argv):
        sys.exit("error: torchrun runs one training run; launch a sweep's jobs with Hydra's launchers instead")
    kept = [a for a in argv if not a.startswith(("hydra.run.dir=", "hydra.output_subdir=", "hydra/job_logging="))]
    return [*kept, "hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=other_ranks"]


def quiet_logging() -> None:
    """Logging as torchrun's other ranks have it (quiet_rank), for the tasks of a submitit job of several
    (hydra.launcher.tasks_per_node): the ranks other than 0 log only their errors, to stderr, not into the job's
    log file, which rank 0 writes."""
    import logging.config
    from pathlib import Path

    from omegaconf import OmegaConf

    other_ranks = OmegaConf.load(Path(__file__).parent / "conf" / "hydra" / "job_logging" / "other_ranks.yaml")
    logging.config.dictConfig(OmegaConf.to_container(other_ranks, resolve=True))


if __name__ == "__main__":
    try:
        check_command_line(sys.argv[1:])  # a mistyped key, option or value: one line, before anything runs
        check_launcher(sys.argv[1:])
        if note := preset_sweep_note(sys.argv[1:]):
            print(note, file=sys.stderr)
    except UserError as e:
        print(error_lines(e), file=sys.stderr)
        sys.exit(1)
    sys.argv[1:] = quiet_rank(with_project_hydra(sys.argv[1:]))  # (a saved config run again: conf/hydra's settings)
    main()
    if failed := sweep.outcome.failed:  # a multirun: read from its jobs' summaries, whichever launcher ran them
        print(f"{len(failed)} sweep job(s) did not complete:", *failed, sep="\n  ", file=sys.stderr)
        if sweep.outcome.fail_on_error:
            sys.exit(1)
