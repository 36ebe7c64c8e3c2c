"""What a run needs to continue exactly where it stopped, and how to find it again.

A training checkpoint (``checkpoints/step_<N>.pt``) holds the model, optimizer, schedule and GradScaler states,
``Progress`` (step, epoch and position in the epoch's batch order (in batches, whatever the number of ranks), best validation score, accumulation after
out-of-memory back-offs, skipped steps, the running totals of the summary), the random number generators
(Python's and torch's, CPU and CUDA; numpy's is never used), and the model settings and resolved config. The
batch order of an epoch is a function of (seed, epoch), so the position in it is enough to continue the data.

Checkpoints are written atomically (``fileio.atomic_path``) and read with ``weights_only=True``; the last
``trainer.keep_last`` are kept, with ``best.pt``. ``trainer.resume=auto`` takes the newest one that can be read,
saying which ones it passed over; ``ckpt_path=...`` names one.
"""

from __future__ import annotations

import logging
import random
import re
import shutil
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from .checkpoint import checkpoint_step, load_checkpoint, unreadable_because, zipped
from .errors import ConfigError
from .loggers import WANDB_ID_FILE, hydra_job, run_dir_key

log = logging.getLogger(__name__)
STEP_FILE = re.compile(r"^step_(\d+)\.pt$")


@dataclass
class Progress:
    step: int = 0
    epoch: int = 0
    batches_done: int = 0  # batches of ``epoch``'s order already trained, on all ranks together
    # the pairs of ``epoch`` already trained (TrainingRun.steps): a bool per training pair (``trained_mask``); not in
    # Progress's ``==``, where a tensor of several values has no truth value
    trained: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool), compare=False)
    best_bleu: float = -1.0
    best_step: int = 0
    last_eval_step: int = -1
    valid_scores: dict = field(default_factory=dict)
    accum_steps: int = 1
    backoffs: list = field(default_factory=list)
    nonfinite_skips: int = 0
    totals: dict = field(default_factory=dict)  # the training window's running totals (tokens, seconds, ...)
    memory: dict = field(default_factory=dict)  # the memory ledger's peaks so far (PeakMemory.run_state)
    window: dict = field(default_factory=dict)  # a stop's log window, still open: the resumed run logs it whole
    resumes: list = field(default_factory=list)  # each resume: its step and the settings changed there

    def to_dict(self) -> dict:
        """As a checkpoint holds it: ``trained`` as the indices of the pairs trained, one int32 tensor (a list of
        millions of ints, late in an epoch of a WMT-sized corpus, took seconds to copy, save and load in every
        checkpoint: 4.0, 1.2 and 4.7 s at 4.5M)."""
        state = asdict(replace(self, trained=None))
        state["trained"] = self.trained.nonzero().flatten().to(torch.int32)
        return state

    def forget_validations(self) -> None:
        """No validation yet: the best checkpoint will be among the validations from here on."""
        fresh = Progress()
        self.best_bleu, self.best_step, self.valid_scores, self.last_eval_step = (
            fresh.best_bleu, fresh.best_step, fresh.valid_scores, fresh.last_eval_step)

    @classmethod
    def from_checkpoint(cls, ckpt: dict, pairs: int) -> Progress:
        """A checkpoint's progress, for a run of ``pairs`` training pairs. Counted in batches, it resumes with any
        number of ranks; checkpoints written before 2026-12-02 counted optimizer steps (``batch_in_epoch``) of one
        batch per rank."""
        state = dict(ckpt["progress"])
        state["trained"] = trained_mask(state.get("trained", []), pairs)  # a list before 2026-12-04, none before -03
        if "batch_in_epoch" in state:
            ranks = ckpt.get("rng_ranks")  # one random state per rank: a data-parallel run's
            state["batches_done"] = state.pop("batch_in_epoch") * (len(ranks) if ranks else 1)
        return cls(**state)


def trained_mask(indices, pairs: int) -> torch.Tensor:
    """``Progress.trained`` from the indices of the pairs trained (a tensor or a list); an index past ``pairs``
    (a checkpoint of a larger corpus, which resuming warns of) marks nothing, as it matched no pair before."""
    indices = torch.as_tensor(indices, dtype=torch.long)
    mask = torch.zeros(pairs, dtype=torch.bool)
    mask[indices[indices < pairs]] = True
    return mask


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_initialized():  # a GPU run's (a CPU run on a GPU machine starts no CUDA context for them)
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(_as_tuples(state["python"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():  # a machine with fewer GPUs: theirs (one per visible device)
        torch.cuda.set_rng_state_all(state["cuda"][:torch.cuda.device_count()])


def restore_rng_state(ckpt: dict, rank: int, seed: int) -> bool:
    """Set this rank's random generators from a training checkpoint: those the rank saved, where the checkpoint
    has a rank of that number (rank 0's are ``rng``; one process's checkpoint has no others). A rank the checkpoint
    did not have (more ranks than wrote it) draws a stream of its own from (seed, step, rank): ranks that shared
    one stream would draw the same dropout masks. Returns whether the rank continued a saved stream."""
    saved = ckpt.get("rng_ranks") or [ckpt["rng"]]
    if rank < len(saved):
        set_rng_state(saved[rank])
        return True
    stream = random.Random(f"{seed}/{ckpt['progress']['step']}/{rank}").getrandbits(63)
    random.seed(stream)
    torch.manual_seed(stream)  # the CUDA generators too
    return False


def _as_tuples(x):
    """``random.setstate`` wants the nested tuples ``getstate`` gave (a checkpoint may hand back lists)."""
    return tuple(_as_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


def step_checkpoints(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """The training checkpoints in a directory, newest first."""
    if not ckpt_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_dir.iterdir() if (m := STEP_FILE.match(p.name))]
    return sorted(found, reverse=True)


def drop_later_checkpoints(ckpt_dir: Path, step: int, best_is_stale: bool | None = None) -> list[Path]:
    """Remove the checkpoints in ``ckpt_dir`` written after ``step`` by an attempt a resumed run does not continue
    (one that stopped after writing them, when an older checkpoint is resumed; the unreadable ones resume=auto
    passed over): pruning keeps the highest step numbers, average_last averages the newest, and a later
    resume=auto takes the newest, so they would pass for this run's. ``best.pt`` too where ``stale_best`` says so
    (``best_is_stale``: what the caller's call of it said). Returns what was removed."""
    later = [path for s, path in step_checkpoints(ckpt_dir) if s > step]
    best = ckpt_dir / "best.pt"
    if best_is_stale if best_is_stale is not None else stale_best(best, step):
        later.append(best)
    for path in later:
        path.unlink(missing_ok=True)
    return later


def stale_best(best: Path, step: int) -> bool:
    """Whether ``best.pt`` is not one a run resumed at ``step`` can test: written after that step (by an attempt
    that stopped), or unreadable (a crash mid-write cannot leave one, a disk can), which testing would fail on at
    the end of the run."""
    if not best.is_file():
        return False
    try:
        written = checkpoint_step(best, io_errors=True)
    except (OSError, MemoryError) as e:  # not the file's own failure: kept, for the end of the run to read again
        log.warning("cannot read %s now (%s): kept", best, e)
        return False
    return written is None or written > step


def prune(ckpt_dir: Path, keep: int, every: int | None = None, final: int | None = None) -> None:
    """Keep the newest ``keep`` step checkpoints. With ``every``, the steps between scheduled checkpoints, those
    off that schedule (``final``, the run's last step, is on it) are a stopped run's, written at whatever step the
    signal came: kept, uncounted, while newer than every scheduled one (the point a resumed run continues from),
    removed once a scheduled one supersedes them, so that keep_last and average_last count the run's schedule as
    a run that never stopped does."""
    found = step_checkpoints(ckpt_dir)
    if every:
        scheduled = [(s, path) for s, path in found if s % every == 0 or s == final]
        newest = scheduled[0][0] if scheduled else -1
        for s, path in found:
            if (s, path) not in scheduled and s < newest:
                path.unlink(missing_ok=True)
        found = scheduled
    for _, path in found[max(1, keep):]:
        path.unlink(missing_ok=True)


# what a step checkpoint holds to resume from
TRAINING_STATE = {"progress", "model", "optimizer", "scheduler", "scaler", "rng"}


def is_training_state(state) -> bool:
    """A checkpoint train.py can resume from: its parts, and a step (without one, Progress took step 0, and the
    resumed run removed the later checkpoints, the one it resumed from among them)."""
    return (isinstance(state, dict) and state.keys() >= TRAINING_STATE and isinstance(state["progress"], dict)
            and isinstance(state["progress"].get("step"), int))


def nonfinite_tensor(state: dict) -> str | None:
    """The first weight or optimizer state of a checkpoint that is NaN or infinite (bytes changed on disk that
    still load: resumed, every step was skipped as non-finite), by name; None when all are finite."""
    named = [*state["model"].items(),
             *((f"optimizer state {k}.{n}", t) for k, v in state["optimizer"].get("state", {}).items()
               for n, t in v.items())]
    return next((name for name, t in named if torch.is_tensor(t) and t.is_floating_point()
                 and not bool(torch.isfinite(t).all())), None)


def find_resume(ckpt_path: str | None, resume: str | None, ckpt_dir: Path) -> tuple[Path, dict] | None:
    """The checkpoint to resume from and its contents: with ``resume=auto`` the newest readable one in ``ckpt_dir``,
    the run's own; else (or where it has none yet) ``ckpt_path`` if given; else None, a fresh start. A requeued
    job started from another run's checkpoint (``ckpt_path``) so continues from its own, not from that one."""
    if resume == "auto" and (own := newest_readable(ckpt_dir, "trainer.resume=never starts over and removes "
                                                             "them")) is not None:
        return own
    if ckpt_path:
        path = Path(ckpt_path).expanduser()
        if path.is_dir():  # a run directory (or its checkpoints/): the newest checkpoint it holds
            found = newest_readable(path / "checkpoints" if (path / "checkpoints").is_dir() else path,
                                    f"ckpt_path={ckpt_path}: name a readable checkpoint")
            if found is None:
                raise ConfigError(f"ckpt_path={ckpt_path}: a directory without a readable checkpoint (step_<N>.pt "
                                  "or best.pt); name a run directory or a checkpoint file")
            log.info("ckpt_path=%s: resuming from its newest checkpoint, %s", ckpt_path, found[0])
            path, state = found
        elif not path.exists():
            raise ConfigError(f"ckpt_path={ckpt_path}: no such file")
        else:
            try:
                state = load_checkpoint(path)
            except Exception as e:
                why = unreadable_because(e) if zipped(path) else "not a zip archive, as torch.save writes: a text file?"
                raise ConfigError(f"ckpt_path={ckpt_path}: not a readable checkpoint ({why})") from None
        if not is_training_state(state):
            raise ConfigError(f"ckpt_path={ckpt_path}: not a training checkpoint of train.py (it lacks the "
                              f"{', '.join(sorted(TRAINING_STATE))} a run resumes from: a bare state_dict?)")
        if name := nonfinite_tensor(state):
            raise ConfigError(f"ckpt_path={ckpt_path}: {name} holds NaN or infinite values")
        return path, state
    if resume not in (None, "never", "auto"):
        raise ConfigError(f"trainer.resume={resume}: expected auto, never or null")
    return None


def same_checkpoint_on_every_rank(world, resumed: tuple[Path, dict] | None) -> tuple[Path, dict] | None:
    """Rank 0's choice of ``find_resume`` on every rank. Each rank chose the newest checkpoint it could read, and
    a file another rank could not read for a moment (a network file system's error, the host out of memory with N
    ranks loading at once) would resume the ranks from different steps, silently: DDP's weights agree, the
    optimizer states and data positions do not. A rank that chose otherwise loads rank 0's, or stops the run."""
    if not world.distributed:
        return resumed
    mine = str(resumed[0].resolve()) if resumed else None
    chosen = world.broadcast(mine)
    if chosen == mine:
        return resumed
    if chosen is None:  # rank 0 starts afresh
        return None
    try:
        state = load_checkpoint(chosen)
    except Exception as e:
        raise ConfigError(f"{chosen}: rank 0 resumes from it, rank {world.rank} cannot read it "
                          f"({unreadable_because(e)})") from None
    log.warning("rank %d: resuming from %s, rank 0's choice (this rank found %s)", world.rank, chosen,
                mine or "none to resume from")
    return Path(chosen), state


def newest_readable(ckpt_dir: Path, hint: str) -> tuple[Path, dict] | None:
    """The newest step checkpoint in ``ckpt_dir`` that can be read, and its contents; each one passed over is
    named in a warning. ``best.pt`` is one of them, by its step (a whole training state too): with
    trainer.save_every above eval_every it can be the newest a killed run left. None where there is none; where
    none of them can be read, a ConfigError that names each and why, ending with ``hint``: a failure that is not
    the files' own (the host out of memory, a network file system's error) must not start the run over."""
    candidates = step_checkpoints(ckpt_dir)
    best = ckpt_dir / "best.pt"
    best_step = checkpoint_step(best) if best.is_file() else None
    if best_step is not None:  # by its step among them; a step checkpoint of the same step comes first
        candidates = sorted([*candidates, (best_step, best)], key=lambda c: (c[0], c[1] != best), reverse=True)
    passed = []
    for _, path in candidates:
        try:
            state = load_checkpoint(path)
        except Exception as e:
            why = unreadable_because(e)
        else:
            if not is_training_state(state):
                why = "not a whole training checkpoint"
            elif name := nonfinite_tensor(state):
                why = f"{name} holds NaN or infinite values"
            else:
                return path, state
        log.warning("%s is unreadable (%s); trying the previous checkpoint", path, why)
        passed.append(f"{path.name}: {why}")
    if passed:
        raise ConfigError(f"{ckpt_dir}: none of its {len(passed)} checkpoints can be read ({'; '.join(passed)}); "
                          f"nothing was removed: {hint}")
    return None


# Model settings a checkpoint's weights do not fix: a resumed run may change them (fine-tuning with less dropout).
FREE_MODEL_KEYS = ("dropout", "attention_dropout", "activation_dropout", "init", "max_positions")
# Settings whose change makes a resumed run differ from the one that never stopped (a warning, not an error).
EXACT_KEYS = ("seed", "data", "tokenizer", "memory", "optim")


def check_resumable(path: Path, ckpt: dict, model_args: dict, conf: dict, vocab_digests: dict | None = None) -> None:
    """Refuse, in one line, to load a checkpoint into a model of another shape or vocabulary (load_state_dict would
    fail with a page of size mismatches, or, for model.n_heads, load and compute something else; a vocabulary of
    the same size whose ids stand for other words, ``vocab_digests``, would load and train on); warn about the
    settings whose change makes the resumed run differ from an uninterrupted one."""
    saved = ckpt.get("model_args") or {}
    changed = [k for k in model_args if k not in FREE_MODEL_KEYS and k in saved and saved[k] != model_args[k]]
    if changed:
        vocab = any(k.endswith("_vocab") or k == "pad_id" for k in changed)
        named = {k: f"model.{k}" if k in conf.get("model", {}) else k for k in changed}
        raise ConfigError(
            f"{path}: written by another model ("
            + ", ".join(f"{named[k]} {saved[k]} there, {model_args[k]} here" for k in changed) + ")"
            + ("; the data or tokenizer settings differ from that run's" if vocab else "")
            + ": resume with that run's settings (its config.yaml), or start over (trainer.resume=never)")
    saved_vocab = ckpt.get("vocab") or {}  # (none in checkpoints written before it was kept)
    other = [side for side in ("src", "tgt")
             if vocab_digests and side in saved_vocab and saved_vocab[side] != vocab_digests[side]]
    if other:
        raise ConfigError(
            f"{path}: written with another {' and '.join({'src': 'source', 'tgt': 'target'}[s] for s in other)} "
            "vocabulary of the same size (its token ids stand for other words; the data or tokenizer settings differ "
            "from that run's): resume with that run's settings (its config.yaml), or start over (trainer.resume=never)")
    before = ckpt.get("config") or {}
    differ = [k for k in EXACT_KEYS if k in before and before[k] != conf.get(k)]
    if differ:
        log.warning("%s: resumed with other %s settings than the run that wrote it; the rest of this run will not be "
                    "the one that run would have trained", path, ", ".join(differ))


# where a run reads and writes, and how it starts, not what it trains: not a change of the run's settings
PLACE_KEYS = ("paths", "ckpt_path", "trainer.resume")


def config_changes(before: dict, now: dict, prefix: str = "") -> dict:
    """The settings of ``now`` that differ from ``before`` (a checkpoint's config), by dotted key: ``{"optim.lr":
    [0.0005, 0.001]}``; a key one side lacks has null there. Where the run's files are (``PLACE_KEYS``) is left
    out. A resumed run keeps them (``Progress.resumes``): its config.yaml is the last attempt's alone."""
    changes = {}
    for key in [*before, *(k for k in now if k not in before)]:
        name = f"{prefix}{key}"
        if name in PLACE_KEYS:
            continue
        old, new = before.get(key), now.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            changes.update(config_changes(old, new, f"{name}."))
        elif old != new:
            changes[name] = [old, new]
    return changes


# the files a run writes into its directory through a temporary file (fileio's atomic writes); the folders
# checkpoints/ and tokenizer/ hold only the run's own
RUN_FILES = ("summary.json", "test.hyp.txt", "config.yaml", "metrics.jsonl", WANDB_ID_FILE)


def remove_partial_writes(run_dir: Path, ckpt_dir: Path) -> None:
    """The temporary files and folders of the run's writes that SIGKILL cut short (the writer removes its own
    otherwise), never read: a checkpoint's, as large as the model and its optimizer state; the summary's, the test
    translations', the tokenizer's (and the earlier tokenizer folder that atomic_dir moves aside, ``.old``, where the
    kill came between its two renames: the run saves its tokenizer again as it starts). Others' files in the run
    directory (paths.output_dir=. , say) are left."""
    for folder, patterns in ((ckpt_dir, [".*.tmp"]), (run_dir, [f".{name}.*.tmp" for name in RUN_FILES]),
                             (run_dir / "tokenizer", [".*.tmp", ".*.old"])):
        partial = sorted(path for pattern in patterns for path in folder.glob(pattern))
        for path in partial:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        if partial:
            log.warning("removed %s left half-written in %s by a run that was killed while writing: %s",
                        f"{len(partial)} checkpoint(s)" if folder == ckpt_dir else f"{len(partial)} file(s)", folder,
                        ", ".join(path.name for path in partial))


def clear_for_fresh_start(ckpt_dir: Path, resume: str | None, main: bool, start: str = "step 0") -> None:
    """A run that starts afresh (from ``start``: step 0, or another run's checkpoint given as ckpt_path) must not
    share its checkpoint directory with an earlier run's step checkpoints: pruning keeps the highest step numbers,
    average_last averages the newest, and a later ``resume=auto`` would continue the earlier run. With
    ``resume=never`` (start over) they are removed, as are those left with ``resume=auto`` (the unreadable ones
    ``find_resume`` passed over); without a ``resume`` setting the run stops, naming them. The earlier run's
    ``best.pt``, ``summary.json`` and ``test.hyp.txt`` go with them: until this run's first validation, and for good
    if it is killed before, they would pass for this run's (translate.py, a sweep's report)."""
    stale = [path for _, path in step_checkpoints(ckpt_dir)]
    best = ckpt_dir / "best.pt"
    if not stale and not best.is_file():
        return
    if resume not in ("auto", "never"):
        newest = (stale or [best])[0].name
        job = hydra_job()
        if job and Path(job["output_dir"]).resolve() != ckpt_dir.parent.resolve():  # not the hydra.run.dir given
            raise ConfigError(f"{ckpt_dir} holds an earlier run's checkpoints (newest {newest}): this run writes "
                              f"there, not into Hydra's run directory, as its config fixes paths.output_dir (a run's "
                              "config.yaml); run it again from its .hydra/config.yaml, or set paths.output_dir to a "
                              "new directory")
        raise ConfigError(f"{ckpt_dir} holds an earlier run's checkpoints (newest {newest}): add "
                          "trainer.resume=auto to continue that run, trainer.resume=never to start over (they are "
                          f"removed), or set {run_dir_key()} to a new directory")
    if main:
        for path in [*stale, best, ckpt_dir.parent / "summary.json", ckpt_dir.parent / "test.hyp.txt"]:
            path.unlink(missing_ok=True)
        removed = f"the {len(stale)} {'unreadable ' if resume == 'auto' else ''}checkpoints in {ckpt_dir} and " if stale else ""
        log.warning("trainer.resume=%s: removed %sthe earlier run's best.pt and summary; training starts from %s",
                    resume, removed, start)
