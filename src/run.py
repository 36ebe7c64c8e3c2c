"""``train(cfg)``: a whole run from a composed config. It turns the ``DictConfig`` into plain data
(``settings.resolve_config``), and everything it calls takes plain arguments.

Flow: corpus -> tokenizers and encoded splits (cached) -> truncation -> model, optimizer, schedule ->
training loop with periodic validation (loss, BLEU), best and last checkpoints -> test BLEU of the best
checkpoint -> ``summary.json``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from .building import build_model, build_optimizer, model_args, rank_seed, seed_everything
from .checkpoint import averaged_checkpoint, save_checkpoint
from .data.batching import EpochBatches, epoch_batches, micro_batches, pair_sizes, split_batch, target_sizes
from .data.prepare import prepare_data
from .distributed import (
    RankSteps,
    World,
    check_one_slurm_task,
    ddp_bucket_bytes,
    full_state,
    fully_shard_net,
    load_full_state,
    process_group,
    shared_cores_tasks,
    world_from_env,
)
from .environment import environment
from .errors import ConfigError, NumericalError, UserError
from .evaluate import Evaluator, check_scoring, evaluation_sets
from .faults import Fault, Interrupted, continue_where, fault_settings, resume_setting, stop_on_signals
from .fileio import link_atomically, locked, write_json, write_text
from .gpu_cap import gpu_memory_cap
from .kernels import attention_backends, attention_names, check_attention, deterministic_algorithms, matmul_precision
from .loggers import NullLogger, RunLogger, hydra_job, run_dir_key, run_name
from .memory import (
    MemoryStrategy,
    PeakMemory,
    free_earlier_runs,
    freed_host_memory_kept,
    keep_freed_host_memory,
    memory_strategy,
    peak_rss_mb,
    reset_peak_rss,
    return_host_memory,
    step_shapes,
)
from .model import Transformer
from .planning import choose_for_budget, context_gb
from .profiling import StepProfiler
from .settings import check_settings, check_threads, from_launch_dir, resolve_config, resolve_device, unresolved
from .state import (
    Progress,
    check_resumable,
    clear_for_fresh_start,
    config_changes,
    drop_later_checkpoints,
    find_resume,
    prune,
    remove_partial_writes,
    restore_rng_state,
    rng_state,
    same_checkpoint_on_every_rank,
    stale_best,
    step_checkpoints,
    trained_mask,
)
from .tokenizers import save_codecs
from .trainer import AgreedOutOfMemoryError, LossModule, Trainer
from .window import Window

OPTIM_SETTINGS = ("betas", "eps", "weight_decay")  # Adam's, from optim: the configured ones win over a checkpoint's
log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------ run dir


def holds_earlier_run(run_dir: Path) -> bool:
    """Whether the directory holds a run that an attempt refused before it started must leave as it is: checkpoints,
    or a completed run's summary (an earlier failed attempt's summary gives way to this one's)."""
    if any(checkpoint_dir(run_dir).glob("*.pt")):
        return True
    try:
        return json.loads((run_dir / "summary.json").read_text(encoding="utf-8")).get("status") == "completed"
    except (OSError, ValueError, AttributeError):
        return False


def checkpoint_dir(run_dir: Path) -> Path:
    """Where a run keeps its step checkpoints and best.pt."""
    return run_dir / "checkpoints"


# ----------------------------------------------------------------------------------------------------- run


def train(cfg: DictConfig) -> dict:
    """Train and evaluate one run; writes ``config.yaml``, ``metrics.jsonl``, checkpoints and ``summary.json``
    into ``cfg.paths.output_dir`` and returns the summary. Errors are recorded in the summary, then raised."""
    started = time.perf_counter()
    free_earlier_runs()  # a sweep's earlier job, in this process
    if torch.cuda.is_initialized():  # and the blocks the allocator kept for it: this run's reserved memory is its own
        torch.cuda.empty_cache()
    reset_peak_rss()
    world, job = world_from_env(), hydra_job()  # torchrun's rank (rank 0 alone writes the run's files); Hydra's job
    record = RunRecord(_output_dir(cfg, job), job, world.main)
    threads = torch.get_num_threads()  # trainer.threads applies to this run only (a sweep's jobs share a process)
    try:
        record.conf = conf = from_launch_dir(resolve_config(cfg))
        strategy = memory_strategy(conf["memory"], conf["data"].get("max_tokens"))
        record.summary["strategy"] = strategy.label
        check_settings(conf)
        check_threads(conf["trainer"])
        device = world.device(resolve_device(conf["trainer"]["device"]))
        if world.main:
            record.summary["environment"] = environment(device)
        check_one_slurm_task(world)
        if strategy.fsdp and not world.distributed:
            raise ConfigError(f"memory=fsdp shards over 2 or more ranks of torchrun (this run has {world.size}): "
                              "torchrun --nproc_per_node=N train.py ..., N >= 2")
        tr = conf["trainer"]
        card_context = context_gb({**(conf.get("plan") or {}), "device": "cuda"})  # what trainer.gpu_gb's card holds
        with (gpu_memory_cap(tr.get("gpu_gb"), card_context, device),
              process_group(world, device), deterministic_algorithms(tr["deterministic"]),
              attention_backends(tr.get("attention")), matmul_precision(tr.get("matmul_precision", "highest"))):
            record.run_dir = run_dir = Path(world.broadcast(str(record.run_dir.resolve())))  # rank 0's, on every rank
            if world.main:
                hold_run_dir(run_dir, record.held)
            ckpt_dir = checkpoint_dir(run_dir)
            resume = resume_setting(tr, ckpt_dir)
            resumed = same_checkpoint_on_every_rank(world, find_resume(conf.get("ckpt_path"), resume, ckpt_dir))
            continues_here = resumed is not None and resumed[0].resolve().parent == ckpt_dir  # its own checkpoint
            if not continues_here:  # from step 0, or from another run's checkpoint (ckpt_path): a fresh start here
                clear_for_fresh_start(ckpt_dir, resume, world.main, start=str(resumed[0]) if resumed else "step 0")
            if world.main:
                remove_partial_writes(run_dir, ckpt_dir)
            record.summary.update(_run(conf, strategy, run_dir, lambda: record.begin(continues_here), world, device,
                                       resumed, reached=record.summary, relabel=record.relabel))
        record.summary["status"] = "completed"
    except BaseException as e:
        record.stopped(e)
        raise
    finally:
        torch.set_num_threads(threads)
        record.close(wall_s=time.perf_counter() - started)
        # the pages malloc kept for the run's freed tensors: a notebook's process would hold the run's peak until
        # its next run (the next job of a sweep gives them back at its start). A collection here costs 0.2 s a run
        # and returned nothing more (model=small, 20 steps: 338 MB resident after return either way, 550 without
        # the trim, 235 before the run)
        return_host_memory()
    return record.summary


def _output_dir(cfg: DictConfig, job: dict) -> Path:
    """``paths.output_dir``, made; with a warning where it is not the directory Hydra made for the run."""
    try:
        run_dir = Path(cfg.paths.output_dir)
    except OmegaConfBaseException as e:  # composed in a notebook without it: one line, not OmegaConf's traceback
        raise unresolved(e) from None
    run_dir.mkdir(parents=True, exist_ok=True)
    if job and Path(job["output_dir"]).resolve() != run_dir.resolve():
        log.warning("this run writes into paths.output_dir=%s, not into Hydra's run directory %s: a config that "
                    "fixes paths.output_dir (a run's config.yaml) writes into that run; to run a run again, give "
                    "its .hydra/config.yaml (README, Experiment presets)", run_dir, job["output_dir"])
    return run_dir


class RunRecord:
    """What one attempt at a run writes about itself, on rank 0: its ``config.yaml`` and logger (metrics.jsonl,
    W&B) when it begins, and ``summary.json`` when it ends, however it ends. ``held`` is this process's hold on the
    run directory (``hold_run_dir``), until the summary is written."""

    def __init__(self, run_dir: Path, job: dict, main: bool):
        self.run_dir, self.job, self.main = run_dir, job, main
        self.summary: dict = {"status": "failed", "overrides": self.job.get("overrides", [])}
        self.conf: dict | None = None  # the resolved config, once it resolves
        self.logger: RunLogger | None = None
        # False while this attempt may still be refused before it starts (a resume whose checkpoint does not fit):
        # until then it writes nothing over an earlier attempt's files, summary.json included
        self.claimed = False
        self.held = contextlib.ExitStack()
        self.busy = False  # another live process holds run_dir: this one writes nothing there
        self.logger_failed = False  # the logger itself could not start

    def begin(self, continues_here: bool) -> RunLogger | NullLogger:
        """The run starts: its config and its logger, on rank 0. ``continues_here``: it resumes its own checkpoint,
        and the earlier attempt's results go (this one's are written at its end, or failure)."""
        self.claimed = True
        if not self.main:
            return NullLogger()
        if continues_here:
            for name in ("summary.json", "test.hyp.txt"):
                (self.run_dir / name).unlink(missing_ok=True)
        try:
            self.logger = self._start_logger(resuming=continues_here)
        except Exception:
            self.logger_failed = True  # not started again to record the failure (W&B's server waited for once)
            raise
        return self.logger

    def _start_logger(self, resuming: bool) -> RunLogger:
        write_text(self.run_dir / "config.yaml", OmegaConf.to_yaml(self.conf))
        label, overrides = self.summary.get("strategy", "?"), self.summary["overrides"]
        group = self.conf.get("sweep_name") or self.job.get("sweep_dir")
        return RunLogger(self.run_dir, self.conf["logger"], {**self.conf, "strategy": label, "overrides": overrides},
                         name=run_name(label, overrides), group=group, resuming=resuming)

    def relabel(self, label: str) -> None:
        """memory=auto's choice, made once the data is read: the summary's and the W&B run's strategy."""
        self.summary["strategy"] = label
        if self.logger is not None:
            self.logger.relabel(label, run_name(label, self.summary["overrides"]))

    def stopped(self, e: BaseException) -> None:
        """The run stopped with ``e``: its status and error (none where another process holds its directory)."""
        if isinstance(e, RunDirBusy):
            self.busy = True
            return
        self.summary.update(_failure(e))
        if isinstance(e, torch.OutOfMemoryError):
            # The frames the error passed through hold the model, its optimizer state and the step's tensors, as
            # long as the error lives: in a notebook (IPython keeps the last one), on the card the next cell's run
            # needs. Their local variables go (the traceback still prints); other errors keep them for %debug.
            for error in (e, e.__cause__, e.__context__):
                if error is not None:
                    traceback.clear_frames(error.__traceback__)

    def close(self, wall_s: float) -> None:
        """``summary.json``, unless another process holds the directory, or this attempt was refused before it
        began and the directory holds an earlier run's results; then the logger's end and the hold let go."""
        self.summary["wall_s"] = round(wall_s, 2)
        self.summary["peak_rss_mb"] = round(peak_rss_mb(), 1)
        writes = self.main and not self.busy and (self.claimed or not holds_earlier_run(self.run_dir))
        if writes:
            write_json(self.run_dir / "summary.json", self.summary)
        if (writes and self.logger is None and not self.logger_failed and self.conf is not None
                and self.summary["status"] in ("failed", "oom")):
            # stopped by a setting before the run began (model.n_heads=3 in a sweep, say): its config and W&B run
            # record the failure too, as those of a run that failed later do
            try:
                self.logger = self._start_logger(resuming=False)
            except Exception as e:  # the logger's own settings, say: summary.json has the failure
                if str(e) != self.summary.get("error"):  # (the run's own error is said once, by whoever raises it)
                    log.warning("the failure is in summary.json only: no logger (%s: %s)", type(e).__name__, e)
        if self.logger is not None:
            self.logger.finish(self.summary)
        self.held.close()


def _failure(e: BaseException) -> dict:
    """The summary's status (and error) for a run stopped by ``e``."""
    if isinstance(e, torch.OutOfMemoryError):
        error = str(e).splitlines()[0]
        log.error("out of memory: %s", error)
        return {"status": "oom", "error": error}
    if isinstance(e, KeyboardInterrupt):  # the reason too: where it stopped and how to continue (faults.Interrupted)
        return {"status": "interrupted", "error": str(e) or "KeyboardInterrupt (Ctrl-C before training began)"}
    if isinstance(e, Exception):
        return {"status": "failed", "error": str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}"}
    return {}  # SystemExit, GeneratorExit: the summary stays "failed", without an error


def _accum_from_here(p: Progress, configured: int) -> int:
    """A resumed run's accumulation: memory.accum_steps as configured now (memory=accum added to fit), or the last
    out-of-memory back-off's where that raised it higher (the run ran out of memory with fewer)."""
    backed_off = p.backoffs[-1]["accum_steps"] if p.backoffs else 0
    kept = max(configured, backed_off)
    if p.accum_steps != kept:
        log.info("accum_steps %d from here (the checkpoint's %d%s)", kept, p.accum_steps,
                 ", raised by an out-of-memory back-off" if kept == backed_off > configured else "")
    return kept


RUN_LOCK = ".lock"  # in the run directory: held by the process that runs there (hold_run_dir)


class RunDirBusy(ConfigError):
    pass


def hold_run_dir(run_dir: Path, held: contextlib.ExitStack) -> None:
    """This process's hold on its run directory until ``held`` closes: a second process given the same directory
    (two runs told one hydra.run.dir, a job launched twice) is refused in one line, rather than resuming the live
    run's checkpoints, removing those it wrote since, and writing into its files. The lock is the kernel's: a
    killed run leaves none, so a requeued job takes its directory back."""
    lock = run_dir / RUN_LOCK
    if not held.enter_context(locked(lock, wait=False, note=f"pid {os.getpid()} on {socket.gethostname()}\n")):
        holder = lock.read_text(encoding="utf-8").strip() if lock.is_file() else ""
        raise RunDirBusy(f"{run_dir}: another process is running in this directory ({holder or 'its lock: ' + str(lock)});"
                         f" give this run its own ({run_dir_key()}=...), or wait for that one to end")


def check_sweep_job(path: Path, ckpt: dict, strategy: MemoryStrategy, run_dir: Path) -> None:
    """A sweep's job resuming its own checkpoint under another memory strategy is refused: a sweep relaunched
    with another list of jobs (memory=none,amp again as memory=amp,none) gives a job's number to another job, which
    carried on the first one's run and reported its peaks and tokens/s under its own label. A single run carries on
    (with check_resumable's warning): memory=accum added to fit, say."""
    if hydra_job().get("sweep_dir") is None or strategy.auto or not ckpt.get("strategy"):
        return
    try:
        before = MemoryStrategy(**ckpt["strategy"])
    except (TypeError, UserError):  # written by another version of MemoryStrategy
        return
    if before.auto or before.label == strategy.label:
        return
    raise ConfigError(f"{path}: this sweep job's earlier launch trained memory strategy {before.label}, and this "
                      f"launch gives the job {strategy.label} (a sweep relaunched with another list of jobs gives a "
                      "job's number to another job): relaunch the sweep as it was, or into a new hydra.sweep.dir; "
                      f"or go on as {strategy.label} in a single run (hydra.run.dir={run_dir} trainer.resume=auto)")


def _run(conf: dict, strategy: MemoryStrategy, run_dir: Path, begin: Callable[[], RunLogger | NullLogger],
         world: World, device: torch.device, resumed: tuple[Path, dict] | None, reached: dict,
         relabel: Callable[[str], None]) -> dict:
    """``begin`` starts the run's files: at once for a fresh run (a failed job is a failed run of its sweep),
    only after its checkpoint is accepted for a resumed one (a refused resume leaves the earlier run's files).
    A run that stops once training has begun (a signal, out of memory, an error) puts what it had reached into
    ``reached`` (the summary): its steps, throughput and memory peaks, its best validation."""
    run = TrainingRun(conf, strategy, run_dir, begin, world, device, resumed, relabel)
    try:
        run.fit()
        if not world.main:
            world.barrier(long_wait=True)  # rank 0 tests
            return {**run.info, "steps": run.p.step}
        test_scores = run.test()
        world.barrier(long_wait=True)
    except BaseException:
        if world.main:
            reached.update(run.info, **run.figures())
        raise
    finally:
        run.close()
    return run.summary(test_scores)


class TrainingRun:
    """One run of ``_run``: the constructor sets it up (its data, model, optimizer and trainer, evaluator and
    memory tracker, a resumed checkpoint, in that order), ``fit`` trains it, ``test`` translates the test set
    with the model chosen for it, and ``summary`` is what the run reached."""

    def __init__(self, conf: dict, strategy: MemoryStrategy, run_dir: Path,
                 begin: Callable[[], RunLogger | NullLogger], world: World, device: torch.device,
                 resumed: tuple[Path, dict] | None, relabel: Callable[[str], None]):
        self.conf, self.run_dir, self.begin, self.world, self.device = conf, run_dir, begin, world, device
        self.relabel = relabel
        self.tr, self.data, self.optim = conf["trainer"], conf["data"], conf["optim"]
        self.logger = begin() if resumed is None else None
        self._prepare_data(strategy)
        self._build_model()
        self._plan_batches_and_evaluation()
        self._compile_and_watch_memory()
        self._read_settings()
        self.p = Progress(accum_steps=self.strategy.accum_steps, trained=trained_mask([], len(self.train_split)))
        self.window = Window(device, world)
        self.saved_step = -1  # the step of the newest step checkpoint written by this process
        self.best_written = -1  # and of its newest best.pt
        if resumed is not None:
            self._resume(*resumed)
        self._start()

    # ------------------------------------------------------------------------------------------------- set-up

    def _prepare_data(self, strategy: MemoryStrategy) -> None:
        """The checks that need no data, this process's settings for the run, then its data; memory=auto
        chooses ``self.strategy`` from it."""
        tr, device, world = self.tr, self.device, self.world
        strategy.check_device(device)
        if not strategy.auto:  # memory=auto's precision is chosen once the data is read: checked then
            self._check_attention(strategy)  # before the data is read, as the next
        check_scoring(self.data["tgt_lang"])  # before the data is read: a tokenizer BLEU needs and does not have
        if tr.get("threads"):
            torch.set_num_threads(tr["threads"])
        elif shared := shared_cores_tasks():
            torch.set_num_threads(max(1, torch.get_num_threads() // shared))
        reuse_host_memory = device.type == "cpu" and tr["reuse_host_memory"] and keep_freed_host_memory()
        if device.type == "cpu" and not reuse_host_memory and freed_host_memory_kept():
            log.warning("trainer.reuse_host_memory=false, but an earlier run in this process (a sweep's job) made "
                        "malloc keep freed memory, which cannot be undone: this run keeps it too")
            reuse_host_memory = True
        self.fault = Fault(**fault_settings(self.conf, world.rank))
        seed_everything(self.conf["seed"])
        self.corpus, self.encoded, self.train_split, info = prepare_data(self.conf, strategy, world=world)
        self.info = info
        info["device"], info["threads"], info["world_size"] = str(device), torch.get_num_threads(), world.size
        info["reuse_host_memory"] = reuse_host_memory
        info["deterministic"] = tr["deterministic"]
        info["gpu_gb"] = tr.get("gpu_gb")  # the card emulated (trainer.gpu_gb); null: the whole device
        info["matmul_precision"] = torch.get_float32_matmul_precision()
        info["attention"] = attention_names(tr.get("attention"))  # the kernels allowed; None: PyTorch chose
        self.src_codec, self.tgt_codec = self.encoded.src_codec, self.encoded.tgt_codec
        if strategy.auto:
            strategy, info["auto"] = choose_for_budget(self.conf, strategy, self.encoded, self.train_split, device,
                                                       world.size)
            log.info("memory=auto: %s", info["auto"])
            self.relabel(strategy.label)
            self._check_attention(strategy)  # at the precision chosen
        self.strategy = strategy

    def _check_attention(self, strategy: MemoryStrategy) -> None:
        """trainer.attention: kernels that run the model's attention here, at the strategy's precision (one small
        call of each kind: the vocabularies do not matter)."""
        args = model_args(self.conf["model"], 8, 8, False, pad_id=1)
        check_attention(self.tr.get("attention"), args, self.device, strategy.amp_dtype or torch.float32)

    def _build_model(self) -> None:
        """The model, its loss, optimizer and scheduler, and the trainer that steps them."""
        conf, optim, strategy, world = self.conf, self.optim, self.strategy, self.world
        seed_everything(conf["seed"])  # the same initial weights whatever the data loading consumed
        self.model = build_model(conf["model"], self.encoded).to(self.device)
        net = LossModule(self.model, self.tgt_codec.pad_id, optim["label_smoothing"], strategy.loss_chunk)
        if strategy.fsdp:
            fully_shard_net(net, strategy.param_dtype)  # before the optimizer: it must hold the sharded parameters
        self.optimizer, self.scheduler, self.peak_lr = build_optimizer(self.model, optim, self.device,
                                                                       fused=not strategy.fsdp)
        self.trainer = Trainer(self.model, self.optimizer, self.scheduler, strategy, self.device, self.tgt_codec.pad_id,
                               optim["label_smoothing"], optim["clip_grad_norm"], world, net)
        self.trainer.agree_on_oom = world.distributed and strategy.backoffs(world.distributed) > 0
        if world.distributed:  # the same weights on every rank (DDP checks), different dropout masks
            seed_everything(rank_seed(conf["seed"], world.rank))

    def _plan_batches_and_evaluation(self) -> None:
        """The training batches' settings, the evaluation sets and their evaluator; what the run trains, in
        ``info`` and the log."""
        tr, strategy, info = self.tr, self.strategy, self.info
        self.batch_size, self.max_tokens = batch_size, max_tokens = self.data["batch_size"], strategy.max_tokens
        self.sizes = pair_sizes(self.train_split)
        self.overfit = overfit = tr.get("overfit_batches")
        self._batches: tuple[int, EpochBatches] | None = None  # the newest epoch's (``batches``)
        self.tgt_sizes = target_sizes(self.train_split)
        self.steps_per_epoch = len(self.steps(0))  # optimizer steps (under torchrun, each takes a batch per rank)
        overfit_pairs = self.batches(0).pairs.tolist() if overfit else None
        self.eval_sets = evaluation_sets(self.corpus, self.encoded, tr.get("limit_eval"),
                                         (self.train_split, overfit_pairs) if overfit else None)
        del self.corpus  # (its training text was let go once encoded; the held-out sets keep theirs)
        self.evaluator = Evaluator(self.eval_sets, self.encoded, self.device, tr, self.optim["label_smoothing"],
                                   strategy, self.data["tgt_lang"])
        info.update(
            parameters=self.model.num_parameters(),
            batch_size=None if max_tokens else batch_size,
            max_tokens=max_tokens,
            batches_per_epoch=self.steps_per_epoch,
            accum_steps=strategy.accum_steps,
            micro_batch_size=None if max_tokens else -(-batch_size // strategy.accum_steps),
            amp=strategy.amp,
            peak_lr=self.peak_lr,
            eval_pairs={k: len(v.encoded) for k, v in self.eval_sets.items()},
            overfit_batches=overfit,
        )
        log.info(
            "%s: %s parameters, vocab %d/%d, %d training pairs, batches of %s in %d micro-batches, device %s",
            strategy.label, f"{info['parameters']:,}", len(self.src_codec), len(self.tgt_codec), len(self.train_split),
            f"{max_tokens} tokens" if max_tokens else f"{batch_size} pairs",
            strategy.accum_steps if max_tokens else min(strategy.accum_steps, batch_size), self.device,
        )

    def _compile_and_watch_memory(self) -> None:
        """trainer.compile, and the memory tracker (which sees eager operations only)."""
        tr, trainer = self.tr, self.trainer
        track = tr.get("track_memory", True)
        every = tr.get("memory_every")
        if tr.get("compile"):
            trainer.compile()
            if track:
                log.warning("trainer.compile: the tensor tracker sees eager operations only; tensors are not counted"
                            + (" (the CUDA allocator's figures stay)" if self.device.type == "cuda" else ""))
                track = False
        self.peak = PeakMemory(self.device, track=track, every=every)
        self.peak.watch(self.model, self.optimizer, buckets=ddp_bucket_bytes(trainer.net))
        trainer.ledger = self.peak.mark

    def _read_settings(self) -> None:
        """The trainer's settings the loop reads: when it stops, what it checkpoints, what a non-finite step does
        (``fit`` reads the logging, validation and profiling intervals from ``tr`` itself)."""
        tr = self.tr
        self.max_steps, self.max_epochs = tr.get("max_steps"), tr.get("max_epochs")
        self.ckpt_dir = checkpoint_dir(self.run_dir)
        self.best_path = self.ckpt_dir / "best.pt"
        self.ckpt_meta = {"model_args": self.model.args.to_dict(), "strategy": asdict(self.strategy),
                          "vocab": {"src": self.src_codec.vocab_digest(), "tgt": self.tgt_codec.vocab_digest()},
                          "config": self.conf}
        self.save_every = tr.get("save_every") or tr.get("eval_every")
        if not self.save_every and self.world.main:
            log.warning("trainer.eval_every and trainer.save_every are null: no checkpoint before the run ends (a "
                        "signal still writes one; a crash loses the run): trainer.save_every=N keeps one every N steps")
        self.keep_last, self.average_last = tr["keep_last"], tr.get("average_last")
        self.on_nonfinite, self.max_nonfinite = tr["on_nonfinite"], tr["max_nonfinite"]
        self.peak_tflops = tr.get("peak_tflops")

    def _resume(self, path: Path, ckpt: dict) -> None:
        """Continue from a checkpoint: its states, its progress and random generators; ``begin`` once it is accepted."""
        world, ckpt_dir, best_path = self.world, self.ckpt_dir, self.best_path
        check_resumable(path, ckpt, self.model.args.to_dict(), self.conf, self.ckpt_meta["vocab"])
        if path.resolve().parent == ckpt_dir.resolve():  # its own checkpoint (a sweep may fine-tune another run's)
            check_sweep_job(path, ckpt, self.strategy, run_dir=self.run_dir)
        configured_optim = [{k: g[k] for k in OPTIM_SETTINGS if k in g} for g in self.optimizer.param_groups]
        peak_lrs = list(self.scheduler.base_lrs)
        load_full_state(self.model, self.optimizer, ckpt["model"], ckpt["optimizer"], self.strategy.fsdp)
        self.scheduler.load_state_dict(ckpt["scheduler"])
        self._apply_optim_settings(configured_optim, peak_lrs)
        if ckpt["scaler"]:  # a run without fp16 saved none: one resumed with memory.amp=fp16 starts a new scaler
            self.trainer.scaler.load_state_dict(ckpt["scaler"])
        self.logger = self.begin()  # the checkpoint is accepted and loaded: the run's files are this run's from here on
        self.p = p = Progress.from_checkpoint(ckpt, len(self.train_split))
        p.resumes.append({"step": p.step, "changed": config_changes(ckpt.get("config") or {}, self.conf)})
        self.info["resumes"] = p.resumes  # every attempt's changes, those of earlier resumes with the checkpoint
        p.accum_steps = _accum_from_here(p, self.strategy.accum_steps)
        self.window.restore(p.totals)
        self.peak.load_run_state(p.memory)
        if p.window:  # a stop's window: continued, to be logged whole
            self.window.restore(p.window["train"])
            self.peak.load_run_state(p.window["memory"])
        if not restore_rng_state(ckpt, world.rank, self.conf["seed"]):
            log.info("rank %d: the checkpoint was written by %d rank(s); this rank draws a new random stream",
                     world.rank, len(ckpt.get("rng_ranks") or [0]))
        ckpt.clear()  # the model holds its copy now: the checkpoint's is not kept for the whole run
        self.info["resumed_from"] = {"path": str(path), "step": p.step}
        # Checkpoints written after this one, by an attempt that stopped: not this run's history, which may differ
        # (a shorter run, other settings), nor its test model (best.pt, or the newest for average_last)
        later = stale_best(best_path, p.step)
        if world.main and (removed := drop_later_checkpoints(ckpt_dir, p.step, later)):
            log.warning("removed %s: written after step %d by an attempt that stopped, or unreadable", ", ".join(
                stale.name for stale in removed), p.step)
        if later or not best_path.is_file():  # ckpt_path from another run: the best is among this run's validations
            log.info("no %s in this run: the best checkpoint will be among this run's validations", best_path.name)
            p.forget_validations()
        log.info("resuming from %s (step %d, epoch %d, %d batches of the epoch done)", path, p.step, p.epoch,
                 p.batches_done)
        last_epoch_done = (self.max_epochs and p.epoch + 1 >= self.max_epochs
                           and not self.steps(p.epoch, p.batches_done, p.trained))  # (its epoch is not yet counted)
        if self.done() or last_epoch_done:  # a finished run resumed again, or limits set below the checkpoint's
            log.warning("the checkpoint is at step %d (epoch %d), where trainer.max_steps=%s / max_epochs=%s stop: "
                        "nothing is trained", p.step, p.epoch, self.max_steps, self.max_epochs)

    def _apply_optim_settings(self, configured: list[dict], peak_lrs: list[float]) -> None:
        """The optimizer settings as configured now, not as the checkpoint's state has them (loading it put back
        its Adam betas, eps and peak learning rate): a run resumed with optim.lr=1e-4 trains with that peak."""
        sched = self.scheduler
        def plain(v):
            return tuple(v) if isinstance(v, (list, tuple)) else v  # betas: a list once saved

        groups = self.optimizer.param_groups
        # the learning rate of the step resumed at by this run's schedule: the scheduler's state is its step, its
        # schedule is the config's (a warmup_steps of its own changes the rate without changing the peak)
        now = [peak * factor(sched.last_epoch) for peak, factor in zip(peak_lrs, sched.lr_lambdas)]
        changed = {k for g, want in zip(groups, configured) for k in want if plain(g[k]) != plain(want[k])}
        if list(sched.base_lrs) != peak_lrs:
            changed.add("lr")
        elif not all(math.isclose(g["lr"], lr, rel_tol=1e-9) for g, lr in zip(groups, now)):
            changed.add("warmup_steps")
        if not changed:
            return
        for g, want, peak, lr in zip(groups, configured, peak_lrs, now):
            g.update(want)
            g["initial_lr"], g["lr"] = peak, lr
        sched.base_lrs, sched._last_lr = peak_lrs, [g["lr"] for g in self.optimizer.param_groups]
        log.warning("resumed with other optimizer settings than the checkpoint's (%s): this run's apply from here on",
                    ", ".join(sorted(changed)))

    def _start(self) -> None:
        """The tokenizer's files, the log from the step the run starts at, and the progress bar."""
        if self.world.main:  # after the resume check: a refused resume leaves the tokenizer its checkpoints need
            save_codecs(self.run_dir / "tokenizer", self.src_codec, self.tgt_codec)
        self.logger.rewind(self.p.step)  # rows logged after the checkpoint resumed here are trained again
        max_steps, max_epochs, epoch_steps = self.max_steps, self.max_epochs, self.steps_per_epoch
        total_steps = min(filter(None, (max_steps, max_epochs and max_epochs * epoch_steps)))  # whichever ends first
        # Where stderr is a file (a cluster job's log, W&B's capture of the console), redrawn every 30 s, not ten
        # times a second: ~100 bytes each, tens of MB in a day-long run's log. tqdm's own pace on a terminal, in a
        # notebook, or where TQDM_MININTERVAL sets it.
        self.bar_live = ("TQDM_MININTERVAL" in os.environ or "ipykernel" in sys.modules
                         or (sys.stderr is not None and sys.stderr.isatty()))
        self.bar = tqdm(total=total_steps, initial=self.p.step,  # one bar: rank 0's, as one rank logs
                        disable=not (self.tr.get("progress", True) and self.world.main),
                        desc=self.strategy.label, dynamic_ncols=True,
                        **({} if self.bar_live else {"mininterval": 30.0, "maxinterval": 30.0}))

    # ------------------------------------------------------------------------------------------------ batches

    def batches(self, epoch: int) -> EpochBatches:
        """An epoch's batches (overfit: the first epoch's first ones, every epoch). The newest epoch's are kept:
        the run's start counts the first epoch's steps, then trains them (0.4-0.6 s to make at 4.5M pairs)."""
        overfit = self.overfit
        epoch = 0 if overfit else epoch
        if self._batches is not None and self._batches[0] == epoch:
            return self._batches[1]
        self._batches = None  # (not held while the next is made)
        try:
            order = epoch_batches(self.sizes, self.batch_size, self.max_tokens, shuffle=True, seed=self.conf["seed"],
                                  epoch=epoch)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if overfit and overfit > len(order):
            raise ConfigError(f"trainer.overfit_batches={overfit}: the training data makes only {len(order)} batches")
        self._batches = (epoch, order[:overfit] if overfit else order)
        return self._batches[1]

    def steps(self, epoch: int, batches_done: int = 0, trained: torch.Tensor | None = None) -> RankSteps:
        """The optimizer steps of an epoch's batches after the first ``batches_done`` (a resumed run's, which
        may have been trained with another number of ranks). Resumed mid-epoch with other batches (another
        batch size or token budget), the first ``batches_done`` are not the pairs trained: the epoch's batches
        go on without the pairs already ``trained`` (``Progress.trained``), so each pair is still trained once."""
        order = self.batches(epoch)
        if (batches_done and trained is not None and trained.any()
                and not torch.equal(trained, trained_mask(order[:batches_done].pairs, len(trained)))):
            return RankSteps(order.without(trained), self.world)
        return RankSteps(order[batches_done:], self.world)

    # --------------------------------------------------------------------------------------------- training

    def fit(self) -> None:
        """Train until trainer.max_steps or max_epochs, validating and checkpointing on the way; then the last
        step's validation and checkpoint. A signal stops the run after its step, with a checkpoint
        (``Interrupted``)."""
        p, tr, world, device = self.p, self.tr, self.world, self.device
        profile_dir = self.run_dir / "profile" / (f"rank{world.rank}" if world.distributed else "")
        # On a terminal, log lines go above the bar (tqdm's logging_redirect_tqdm): printed as they were, each began
        # on the bar's line, after it. Not into a file, where it would redraw the bar after every line.
        logs_above_bar = logging_redirect_tqdm() if self.bar_live and not self.bar.disable else contextlib.nullcontext()
        with (stop_on_signals() as stop,
              StepProfiler(profile_dir, tr.get("profile_from"), tr.get("profile_steps", 3), p.step,
                           device) as profiler, logs_above_bar):
            while not self.done():
                for indices, real, group in self.steps(p.epoch, p.batches_done, p.trained):
                    profiler.step()
                    stats, counted = self.train_step(indices, real, group)
                    self.check_finite(stats, p.step + 1)  # (before the window counts it: a stop takes it again)
                    self.window.add(stats, p.epoch, counted)
                    # not alive during the next step: its device scalars would be in that step's peak, but not
                    # in a restarted process's first step (a resumed run's peaks must be the run's)
                    del stats
                    p.step += 1
                    p.batches_done += len(group)
                    p.trained[[i for b in group for i in b]] = True
                    self.bar.update(1)
                    if p.step % tr["log_every"] == 0:
                        self.log_window()
                    states = None  # memory=fsdp: gathered once for a validation and a checkpoint at the same step
                    if tr.get("eval_every") and p.step % tr["eval_every"] == 0:
                        states = self.run_eval()
                    if self.save_every and p.step % self.save_every == 0:
                        self.log_window()
                        self.save(states=states)
                    if world.any(stop.signum is not None):
                        stop.signum = stop.signum or signal.SIGTERM  # one rank was signalled: all stop at this step
                    if stop.signum is not None:
                        self.checkpoint_stop(states)
                        raise Interrupted(stop.signum, p.step, continue_where(hydra_job(), self.run_dir))
                    if self.done():
                        break
                else:
                    p.epoch, p.batches_done = p.epoch + 1, 0
                    p.trained.zero_()
        self.bar.close()
        self.log_window()
        if p.last_eval_step != p.step:
            self.save(states=self.run_eval(), final=True)
        elif self.saved_step != p.step:  # not when the loop's last step wrote it
            self.save(final=True)

    def done(self) -> bool:
        p, max_steps, max_epochs = self.p, self.max_steps, self.max_epochs
        return bool((max_steps and p.step >= max_steps) or (max_epochs and p.epoch >= max_epochs))

    def train_step(self, indices: list[int], real: bool, group: list[list[int]]):
        """One optimizer step. On out-of-memory: drop the partial window's gradients, cut every micro-batch in
        two for the rest of the run (twice the accumulation: the same examples, the same effective batch, the
        same update) and redo the step; after ``memory.oom_retries`` back-offs, fail with a memory snapshot.
        Data-parallel with memory.oom_retries set: every rank learns of one rank's error (Trainer.agree_on_oom) and
        backs off alike, deciding from the step's batches on all ranks."""
        p, peak, world, sizes, tgt_codec = self.p, self.peak, self.world, self.sizes, self.tgt_codec
        step = p.step + 1
        step_tokens = sum(self.tgt_sizes[i] for b in group for i in b)
        retries = self.strategy.backoffs(world.distributed)
        for attempt in range(retries + 1):
            micro = micro_batches(self.train_split, indices, sizes, p.accum_steps, tgt_codec.pad_id, tgt_codec.bos_id,
                                  tgt_codec.eos_id, pin=self.device.type == "cuda")
            parts = len(micro)
            if self.strategy.fsdp and world.distributed:  # as many forward and backward passes on every rank
                micro += micro[-1:] * (max(min(p.accum_steps, len(b)) for b in group) - parts)
            # on one process, a step larger than those the tracker counted is counted (PeakMemory)
            shapes = None if world.distributed else step_shapes(micro, real_targets=bool(self.strategy.loss_chunk))
            try:
                with peak.measure(step, shapes) as counted:
                    self.window.resume(counted)  # a counted step's time apart (Window)
                    self.fault.maybe_raise(step, self.trainer)
                    stats = self.trainer.step(micro, step_tokens, real, real_parts=parts)
                peak.record_history(False)  # after a back-off: the step was redone
                return stats, counted
            except torch.OutOfMemoryError as e:
                self.optimizer.zero_grad(set_to_none=True)
                reason = str(e).splitlines()[0]
                del micro
                largest = max(len(part) for b in group for part in split_batch(b, sizes, p.accum_steps))
                # under torchrun, one rank's error after the ranks agreed to go on (averaging the gradients, the
                # optimizer step) cannot be redone: the others have taken the step; the run stops, not desyncs
                alone = world.distributed and retries > 0 and not isinstance(e, AgreedOutOfMemoryError)
                if attempt == retries or largest == 1 or alone:
                    raise self._final_oom(step, largest, reason, alone, retries) from None
                p.accum_steps = min(p.accum_steps * 2, max(len(b) for b in group))
                p.backoffs.append({"step": step, "accum_steps": p.accum_steps, "error": reason})
                peak.record_history()  # until the step is redone: a final failure comes with a useful snapshot
                log.warning("out of memory at step %d: %s; redoing it with accum_steps %d", step, reason, p.accum_steps)
                self.logger.log({"oom_backoffs": len(p.backoffs), "accum_steps": p.accum_steps}, step)
        raise AssertionError("unreachable")

    def _final_oom(self, step: int, largest: int, reason: str, alone: bool, retries: int) -> torch.OutOfMemoryError:
        """The error a step that cannot be redone ends the run with: why it cannot, and a memory snapshot."""
        p, world = self.p, self.world
        rank = f"_rank{world.rank}" if world.distributed else ""
        snapshot = self.peak.snapshot(self.run_dir / f"oom_snapshot{rank}")
        if alone:
            where = f"on rank {world.rank} alone, after the ranks averaged their gradients (no rank can redo the step then)"
        elif world.distributed and self.strategy.fsdp:
            where = (f"on rank {world.rank}: memory=fsdp takes no back-off (memory.oom_retries); raise "
                     "memory.accum_steps, or plan one with memory=[fsdp,auto]")
        elif world.distributed and retries == 0:
            setting = ("memory.oom_retries=0" if self.strategy.oom_retries == 0
                       else "memory.oom_retries is not set: none by default there")
            where = (f"on rank {world.rank} without back-off under torchrun ({setting}; "
                     "memory.oom_retries=3 has every rank redo the step with twice the accumulation)")
        elif largest == 1:
            where = (f"after {len(p.backoffs)} back-off(s), with micro-batches of one pair that cannot be split further "
                     "(lower the memory of a pair: memory=amp, checkpoint, chunked_ce or truncate; python plan.py "
                     "compares them)")
        else:
            where = (f"after {len(p.backoffs)} back-off(s), the most memory.oom_retries={retries} allows (plan.py, "
                     "or memory=auto memory.budget_gb=..., finds a setting that fits)")
        return torch.OutOfMemoryError(
            f"out of memory at step {step} with micro-batches of up to {largest} pairs (accum_steps {p.accum_steps}) "
            f"{where}: {reason}" + (f"; memory snapshot: {snapshot}" if snapshot else ""))

    def check_finite(self, stats, step: int) -> None:
        """After optimizer step ``step`` (not yet counted): a non-finite one stops the run, which has then taken
        the steps before it (with ``stop``, or past ``max_nonfinite`` skips), or is counted as a step skipped."""
        if not stats.nonfinite:
            return
        p = self.p
        where = f"non-finite loss or gradient at step {step}"
        stops = self.on_nonfinite == "stop" or p.nonfinite_skips + 1 > self.max_nonfinite
        if stops:  # (with the skips so far: resumed, this step is taken again)
            self.save_before_numerical_stop()
        if self.on_nonfinite == "stop":
            raise NumericalError(f"{where}; stopped (trainer.on_nonfinite=stop)")
        p.nonfinite_skips += 1
        if stops:
            n = p.nonfinite_skips
            raise NumericalError(f"{where}: {n} non-finite step{'s' if n != 1 else ''}, more than trainer.max_nonfinite="
                                 f"{self.max_nonfinite} allows to skip; lower the learning rate, or check the data")
        log.warning("%s: update skipped (%d so far; trainer.on_nonfinite=skip)", where, p.nonfinite_skips)
        self.logger.log({"nonfinite_skips": p.nonfinite_skips}, step)

    def checkpoint_stop(self, states: tuple[dict, dict] | None = None) -> None:
        """A stop's checkpoint of the steps taken (a signal's, or a non-finite step's that stops the run), where
        none is yet: off the save schedule, removed at the next scheduled one. One process: it carries the open
        log window, which goes into the stopped run's summary, not into a row of its own, and which the resumed
        run logs whole, as the run never stopped does (under torchrun the ranks' windows are summed as logged)."""
        carry = not self.world.distributed
        if not carry:
            self.log_window()
        if self.saved_step != self.p.step:
            self.save(states=states, carry_window=carry)
        self.window.flush()
        self.peak.skip_window()

    def save_before_numerical_stop(self) -> None:
        """The steps taken before a non-finite step that stops the run, checkpointed: resumed (with a lower
        learning rate, say, or the data mended), the run continues from there rather than from its last scheduled
        checkpoint. The failed step's update was not taken; its batch is trained again."""
        if self.p.step > 0:
            self.checkpoint_stop()
            log.info("checkpoint of step %d written: continue with trainer.resume=auto once the cause is mended",
                     self.p.step)

    def log_window(self) -> None:
        metrics = self.window.flush()
        if metrics:
            if self.peak_tflops:  # the FLOP/s of all ranks against the peak of as many devices
                metrics["mfu"] = metrics["model_tflops"] / (self.peak_tflops * self.world.size)
            metrics.update(self.peak.window_metrics())
            self.logger.log(metrics, self.p.step)
            self.bar.set_postfix(loss=f"{metrics['loss']:.3f}", lr=f"{metrics['lr']:.2e}",
                                 tok_s=f"{metrics['tokens_per_s']:.0f}", mem_mb=metrics.get("peak_memory_mb"),
                                 refresh=self.bar_live)  # into a file: at the next redraw

    def save(self, path: Path | None = None, states: tuple[dict, dict] | None = None, final: bool = False,
             carry_window: bool = False) -> None:
        """A training checkpoint of everything needed to continue exactly from here (with ``carry_window``, a
        stop's: the log window not yet logged too). Data-parallel: called on every rank (each rank's random
        generators are gathered, FSDP's shards too); rank 0 writes it."""
        p, world = self.p, self.world
        step_file = path is None  # else best.pt
        if step_file:
            self.saved_step = p.step
        p.totals, p.memory = self.window.totals(), self.peak.run_state()
        p.window = {"train": self.window.open_state(), "memory": self.peak.window_state()} if carry_window else {}
        model_state, optim_state = states or full_state(self.model, self.optimizer, self.strategy.fsdp)
        rng = rng_state()
        ranks = world.gather(rng) if world.distributed else None
        if not world.main:
            return
        state = dict(model=model_state, optimizer=optim_state, scheduler=self.scheduler.state_dict(),
                     scaler=self.trainer.scaler.state_dict(), progress=p.to_dict(), rng=rng, rng_ranks=ranks,
                     **self.ckpt_meta)
        target = path or self.ckpt_dir / f"step_{p.step:08d}.pt"
        # a step checkpoint at the step best.pt was just written at holds the same state: one file, two names
        same_as_best = step_file and not p.window and self.best_written == p.step
        if not (same_as_best and link_atomically(self.best_path, target)):
            save_checkpoint(target, **state)
        if step_file:
            prune(self.ckpt_dir, self.keep_last, self.save_every, p.step if final else None)
        else:
            self.best_written = p.step

    # ------------------------------------------------------------------------------------------- evaluation

    def evaluation_model(self, model_state: dict | None = None) -> Transformer:
        """The model to evaluate: the trained one, or under memory=fsdp a plain copy (with its gathered weights),
        made for each evaluation and not kept: kept, rank 0 would hold the full weights beside its shards for the
        rest of the run, which neither the ledger nor the planner counts."""
        if not self.strategy.fsdp:
            return self.model
        # its initial weights are overwritten at once: drawn from a fork of the generator, so that evaluating
        # leaves rank 0's random stream (dropout) where it was, as under DDP and in a resumed run
        with torch.random.fork_rng(devices=[]):
            plain = build_model(self.conf["model"], self.encoded).to(self.device)
        if model_state is not None:
            plain.load_state_dict(model_state)
        return plain

    def run_eval(self) -> tuple[dict, dict] | None:
        """Validation. Data-parallel: on rank 0 alone, while the other ranks wait for its scores. memory=fsdp:
        returns the states it gathered, for a checkpoint written at the same step."""
        p, world = self.p, self.world
        self.log_window()  # the training steps so far count; evaluation is neither timed nor measured
        p.last_eval_step = p.step
        states = full_state(self.model, self.optimizer, True) if self.strategy.fsdp else None  # every rank takes part
        scores = self.validate(self.evaluation_model(states and states[0])) if world.main else None
        scores = world.broadcast(scores, long_wait=True)
        # the best validation BLEU; between equal ones the lower NLL (a short run's early validations all score 0,
        # an overfit batch's all 100), not the label-smoothed loss, which rises as the model grows surer of itself
        if scores["bleu"] > p.best_bleu or (scores["bleu"] == p.best_bleu
                                            and scores["nll"] < p.valid_scores.get("nll", math.inf)):
            p.best_bleu, p.best_step, p.valid_scores = scores["bleu"], p.step, scores
            self.save(self.best_path, states)
        self.peak.skip_window()
        return states

    def validate(self, m: Transformer) -> dict:
        p, logger, evaluator = self.p, self.logger, self.evaluator
        t0 = time.perf_counter()
        losses = evaluator.loss(m)
        scores, hyps = evaluator.translate(m, "valid")
        metrics = {f"valid_{k}": v for k, v in losses.items()}
        metrics |= {"valid_bleu": scores["bleu"], "valid_chrf": scores["chrf"], "valid_unk_words": scores["unk_words"]}
        metrics["eval_s"] = round(time.perf_counter() - t0, 2)
        logger.log(metrics, p.step)
        valid = self.eval_sets["valid"].text
        logger.log_samples(p.step, valid.src, valid.tgt, hyps)
        for i in range(min(self.tr.get("num_samples", 0), len(hyps))):
            log.info("  src: %s\n  ref: %s\n  hyp: %s", valid.src[i], valid.tgt[i], hyps[i])
        log.info("step %d: valid loss %.3f, ppl %.2f, BLEU %.2f, chrF %.2f", p.step, losses["loss"], losses["ppl"],
                 scores["bleu"], scores["chrf"])
        return {**scores, "nll": losses["nll"]}

    def test(self) -> dict:
        """Rank 0: the test set's translation (test.hyp.txt) and its scores."""
        average_last, best_path, info = self.average_last, self.best_path, self.info
        # The test set is translated once: by the checkpoint with the best validation BLEU, or with
        # trainer.average_last=N by the mean of the last N step checkpoints' weights (as the paper scored its models).
        # Read on the CPU: a checkpoint holds the optimizer's state too, for which the device may have no room left.
        # memory=fsdp: the copy evaluations use (made here where none ran in this process: a run resumed at its end)
        tested = self.evaluation_model()
        if average_last:
            paths = [path for _, path in step_checkpoints(self.ckpt_dir)[:average_last]][::-1]
            if len(paths) < average_last:
                log.warning("trainer.average_last=%d: the run wrote %d step checkpoints; testing their average",
                            average_last, len(paths))
        else:
            paths = [best_path]
        tested.load_state_dict(averaged_checkpoint(paths, torch.device("cpu"))["model"])
        info["test_checkpoints"] = [path.name for path in paths]
        test_scores, test_hyps = self.evaluator.translate(tested, "test")
        write_text(self.run_dir / "test.hyp.txt", "\n".join(test_hyps) + "\n")
        tested_by = (f"average of {', '.join(info['test_checkpoints'])}" if average_last
                     else f"best checkpoint, step {self.p.best_step}")
        log.info("test BLEU %.2f, chrF %.2f (%s) | %s", test_scores["bleu"], test_scores["chrf"], tested_by,
                 test_scores["bleu_signature"])
        return test_scores

    # ---------------------------------------------------------------------------------------------- results

    def close(self) -> None:
        """After the run, also on failure."""
        self.bar.close()  # also on failure: a sweep's next job puts its bar where this one was
        self.peak.record_history(False)

    def figures(self) -> dict:
        """The training figures so far: steps, throughput (up to the last log line), memory, best validation."""
        p, window, peak, peak_tflops = self.p, self.window, self.peak, self.peak_tflops
        timed = window.total_seconds > 0  # a run stopped before its first log line timed no step: no throughput
        tokens_per_s, flops_per_s, tracked = window.rates(total=True)
        tflops = flops_per_s / 1e12 if timed else None
        return {
            "strategy": self.strategy.label,  # memory=auto: what it chose, e.g. auto(amp+accum)
            "steps": p.step,
            "epochs": round(p.step / self.steps_per_epoch, 3),
            "src_tokens": window.total_src_tokens,
            "tgt_tokens": window.total_tgt_tokens,
            "train_s": round(window.total_seconds, 2),
            "tokens_per_s": round(tokens_per_s, 1) if timed else None,  # over the steps the tracker did not count
            "tokens_per_s_tracked": tracked if timed else None,  # it counted every step: its cost is in tokens_per_s
            "padding_ratio": round(window.padding_ratio(total=True), 4),
            "model_tflops": float(f"{tflops:.4g}") if timed else None,  # model FLOP/s, ModelArgs.training_flops
            "mfu": float(f"{tflops / (peak_tflops * self.world.size):.4g}") if peak_tflops and timed else None,
            "fp16_skipped_steps": window.total_skipped if self.strategy.amp == "fp16" else None,
            "final_accum_steps": p.accum_steps,
            "final_eval_batch_size": self.evaluator.batch_size,
            "oom_backoffs": p.backoffs,
            "nonfinite_skips": p.nonfinite_skips,
            "peak_memory_mb": _round(peak.run_peak_mb()),
            "peak_memory_split_mb": peak.run_peak_split_mb(),
            "memory_delta_mb": peak.run_deltas_mb(),  # the largest change during one forward / one backward pass
            "peak_reserved_mb": _round(peak.run_reserved_mb()),
            "best_step": p.best_step,
            "valid_bleu": p.valid_scores.get("bleu"),
            "valid_chrf": p.valid_scores.get("chrf"),
            "valid_nll": p.valid_scores.get("nll"),
        }

    def summary(self, test_scores: dict) -> dict:
        """What a completed run reached: its settings and data, its training figures, its test scores."""
        return {
            **self.info,
            **self.figures(),
            "test_bleu": test_scores["bleu"],
            "test_decode_s": self.evaluator.decode_s["test"],  # decoding the test set (batched, key/value cache)
            "beam_size": self.tr["beam_size"],  # what the scores were decoded with (1: greedy), and how long
            "length_penalty": self.tr["length_penalty"],
            "max_len_a": self.tr["max_len_a"],
            "max_len_b": self.tr["max_len_b"],
            "test_chrf": test_scores["chrf"],
            "test_unk_words": test_scores["unk_words"],  # unknown words in test.hyp.txt (tokenizers.UNK_TEXT)
            "sacrebleu_signature": test_scores["bleu_signature"],
            "chrf_signature": test_scores["chrf_signature"],
        }


def _round(x: float | None, digits: int = 1) -> float | None:
    return None if x is None else round(x, digits)
