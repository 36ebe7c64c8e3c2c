"""Where a run's figures go: ``metrics.jsonl`` in the run directory always, and W&B when ``logger=wandb`` (each
logger the logger group's settings name: ``BACKENDS`` says how to add another).

W&B, done the way its users expect: one run per job, grouped by sweep (the multirun directory, or ``sweep_name``),
``job_type=train``, named by the strategy label and the job's overrides, tagged from config, with the fully
resolved config as plain data. ``define_metric`` makes the run summaries the best validation BLEU (max) and the
peak memory (max); the run's other figures are summary.json's (tokens/s: all its tokens over all its training
time, as the sweep report has it); every row is logged at its optimizer step; sample translations are logged
as a table at each validation. The run is always finished, with a non-zero exit code and the reason in its summary
when it failed (out-of-memory included), so a sweep's dashboard shows which runs broke and why. A run that resumes
in its own directory (``trainer.resume=auto``, a requeued SLURM job) continues the same W&B run: its id is kept in
``wandb_run_id`` there and passed back with ``resume="allow"``; W&B keeps the rows of the steps it already has, which
the resumed run trains again to the same losses (offline, where W&B ignores ``resume``, both attempts' run files
carry the one id).

W&B is imported only when used. Its mode (online | offline | disabled) comes from ``logger.wandb.mode`` or the
``WANDB_MODE`` environment variable, which wins; the API key is left to ``wandb login`` and never passed or written.
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import os
import re
from pathlib import Path

from .errors import ConfigError, check_number
from .fileio import atomic_path
from .network import unreachable

log = logging.getLogger(__name__)

# Run summaries W&B derives from the logged rows (define_metric); the final summary writes summary.json's figure
# into each, in the shape W&B gives it ({"max": ...}). For tokens_per_s that replaces W&B's plain mean of the
# windows' rates with the run's rate (all its tokens over all its time): the mean of the windows weighted by their
# time, the figure summary.json and the sweep report give.
METRIC_SUMMARIES = {"valid_bleu": "max", "peak_memory_mb": "max", "tokens_per_s": "mean"}
# Set when W&B's server did not answer a job of this process: the later jobs of a sweep fail at once, not after
# waiting as long again each
_server_unanswered: str | None = None
SAMPLE_COLUMNS = ["step", "source", "reference", "hypothesis"]
WANDB_MODES = ("online", "offline", "disabled", "shared", "dryrun", "run")  # wandb's (the last two: legacy names)
WANDB_ID_FILE = "wandb_run_id"  # in the run directory: the W&B run a resumed run continues


def _clean(value):
    """JSON has no NaN or infinity: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def run_dir_key() -> str:
    """The setting that gives a run another directory: Hydra's run directory under train.py, a sweep job's sweep
    directory under ``train.py -m`` (which ignores hydra.run.dir), the config's own where it is composed and run
    from Python (``src.run.train(cfg)``)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return "paths.output_dir"
    return "hydra.sweep.dir" if HydraConfig.get().mode == RunMode.MULTIRUN else "hydra.run.dir"


def hydra_job() -> dict:
    """What Hydra says about the job this process runs: its overrides, its run directory and, in a multirun, the
    sweep directory and job number. Empty outside Hydra (``train(cfg)`` called from Python)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return {}
    from omegaconf import OmegaConf

    from .config_check import without_project_hydra

    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    return {
        # as typed: iterating the ListConfig resolved an override's ${oc.env:...} (a traceback where it is unset);
        # without the one train.py adds to a saved config run again
        "overrides": without_project_hydra(OmegaConf.to_container(hc.overrides.task, resolve=False)),
        "output_dir": hc.runtime.output_dir,
        "sweep_dir": str(hc.sweep.dir) if multirun else None,
        "job_num": hc.job.num if multirun else None,
    }


def run_name(label: str, overrides: list[str]) -> str:
    """The strategy label plus the job's overrides that say what else differs (``amp model=small``, ``amp
    memory.amp=fp16``): the choice of built-in memory options is the label already (their values, bf16 or fp16 say,
    are not), but an option file of one's own is named (``amp+checkpoint memory=lowmem``: two such files may resolve
    to one label); output paths say nothing about the run, nor do trainer.resume (an attempt that continues it
    keeps its name), fail_on_error, tags (W&B shows them apart) and meta.* (notes of one's own)."""
    said = set(re.split(r"[+()]", label))  # auto(amp+accum): auto, amp, accum

    def told(override: str) -> bool:
        key, _, value = override.lstrip("~+").partition("=")
        if key == "memory":
            return set(value.strip("[]").split(",")) <= said
        return (key.startswith(("hydra.", "paths.", "logger", "sweep_name", "meta.", "tags"))
                or key in ("trainer.resume", "fail_on_error"))

    return " ".join([label, *(o for o in overrides if not told(o))])


def wandb_mode(settings: dict) -> tuple[str, str]:
    """W&B's mode and where it is set (``WANDB_MODE``, else ``logger.wandb.mode``). WANDB_MODE wins; the setting
    is checked too, or its typo would show only on a machine without the variable."""
    modes = [("logger.wandb.mode", settings.get("mode", "offline"))]
    if os.environ.get("WANDB_MODE"):
        modes.append(("WANDB_MODE", os.environ["WANDB_MODE"]))
    for source, mode in modes:
        if mode not in WANDB_MODES:
            close = difflib.get_close_matches(str(mode), WANDB_MODES[:3], n=1)
            raise ConfigError(f"{source}={mode}: expected one of {', '.join(WANDB_MODES)}"
                              + (f"; did you mean {close[0]}?" if close else ""))
    return modes[-1]


def wandb_tags(settings: dict) -> list[str]:
    """The run's tags (``logger.wandb.tags=memory``: one tag), within W&B's limit, said before the run starts
    rather than in its validation traceback."""
    tags = settings.get("tags") or []
    tags = [tags] if isinstance(tags, str) else [str(t) for t in tags]
    for tag in tags:
        if not 1 <= len(tag) <= 64:
            raise ConfigError(f"tags={tags}: a W&B tag has 1 to 64 characters; '{tag}' has {len(tag)}")
    return tags


class WandbLogger:
    """Weights & Biases (``logger=wandb``): one run per job, started before the data is read (a setting W&B refuses
    is found at once)."""

    def __init__(self, settings: dict, config: dict, name: str | None, group: str | None, run_dir: Path,
                 resuming: bool):
        import wandb  # imported here: runs without logger=wandb do not need it

        self.samples = int(settings.get("samples") or 0)
        self._logged = False
        source, mode = wandb_mode(settings)
        tags = wandb_tags(settings)
        id_file = run_dir / WANDB_ID_FILE
        run_id = None
        if resuming and id_file.is_file():
            run_id = id_file.read_text(encoding="utf-8").strip() or None
        global _server_unanswered
        if _server_unanswered and mode == "online":
            raise ConfigError(f"{_server_unanswered} (as for an earlier job of this process)")
        # W&B's own error reports, sent to its Sentry where online: off unless WANDB_ERROR_REPORTING says otherwise
        # (without a network they filled the log with urllib3's warnings around the one line that matters)
        os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        timeout = settings.get("init_timeout", 90)
        check_number("logger.wandb.init_timeout", timeout, 0, strict=True)
        offline_hint = "log with logger.wandb.mode=offline and upload later with `wandb sync <run dir>/wandb/offline-run-*`"
        if mode == "online":  # asked once first: wandb.init waits init_timeout for a server that cannot be reached
            # its address: WANDB_BASE_URL, else W&B's settings (`wandb login --host`; read once a process)
            url = os.environ.get("WANDB_BASE_URL") or wandb.setup().settings.base_url
            if why := unreachable(url):
                _server_unanswered = f"{source}={mode}: W&B's server at {url} cannot be reached ({why}); {offline_hint}"
                raise ConfigError(_server_unanswered)
        try:
            self.run = wandb.init(
                settings=wandb.Settings(init_timeout=timeout),
                id=run_id,
                resume="allow" if run_id and mode == "online" else None,  # offline, W&B warns that it ignores it
                project=settings.get("project"),
                entity=settings.get("entity"),
                group=group,
                tags=tags,
                name=name,
                job_type="train",
                mode=mode,
                dir=str(run_dir),
                config=config,
                reinit="finish_previous",  # a sweep's jobs share a process: each gets its own run
            )
        except wandb.errors.UsageError as e:  # online without a key; a project name W&B refuses
            message = str(e).splitlines()[0]
            if message.startswith("Invalid project name"):
                raise ConfigError(f"logger.wandb.project={settings.get('project')}: {message}") from None
            hint = " (or use logger.wandb.mode=offline: no account needed)" if mode == "online" else ""
            raise ConfigError(f"{source}={mode}: {message}{hint}") from None
        except wandb.errors.CommError as e:  # the server did not answer within init_timeout: no network, say
            _server_unanswered = (f"{source}={mode}: W&B's server did not answer within logger.wandb.init_timeout="
                                  f"{timeout} s ({str(e).splitlines()[0]}); {offline_hint}")
            raise ConfigError(_server_unanswered) from None
        if mode != "disabled":
            with atomic_path(id_file) as tmp:
                tmp.write_text(self.run.id + "\n", encoding="utf-8")
        for key, summary in METRIC_SUMMARIES.items():
            self.run.define_metric(key, summary=summary)

    def relabel(self, strategy: str, name: str) -> None:
        self.run.name = name
        self.run.config.update({"strategy": strategy}, allow_val_change=True)

    def log(self, metrics: dict, step: int) -> None:
        self.run.log(metrics, step=step)
        self._logged = True

    def log_samples(self, step: int, sources: list[str], references: list[str], hypotheses: list[str]) -> None:
        """The first ``logger.wandb.samples`` validation translations, as a W&B table."""
        if not self.samples:
            return
        import wandb

        rows = [[step, s, r, h] for s, r, h in list(zip(sources, references, hypotheses))[: self.samples]]
        self.run.log({"valid_samples": wandb.Table(columns=SAMPLE_COLUMNS, data=rows)}, step=step)

    def finish(self, summary: dict) -> None:
        # the last row logged first: W&B commits a step's row when the next one begins, or here, and a row
        # committed after the summary would overwrite its totals (src_tokens, model_tflops, ...) with its own
        if self._logged:  # (with nothing logged, it would be an empty row at step 0)
            self.run.log({}, commit=True)
        # the run's best validation BLEU and peak memory as summary.json has them: the history of this process
        # lacks the steps before a resume, and a run that ran out of memory logged no row holding its peak
        # (in the shape define_metric gives them, {"max": ...}, so that every run's column is the same)
        final = {k: {METRIC_SUMMARIES[k]: v} if k in METRIC_SUMMARIES else v for k, v in summary.items()
                 if _jsonable(v) and not (k in METRIC_SUMMARIES and v is None)}
        self.run.summary.update(final)
        self.run.finish(exit_code=0 if summary.get("status") == "completed" else 1)


# The loggers beside metrics.jsonl, by their key in the logger group (conf/logger/wandb.yaml sets logger.wandb). A
# new one is a class with WandbLogger's constructor and its four methods, entered here, and an option file that
# sets its key: logger=[wandb,<new>] then logs to both.
BACKENDS = {"wandb": WandbLogger}


class RunLogger:
    """A run's figures: every row into ``metrics.jsonl`` in the run directory, and into each logger that the logger
    group's settings name (``logger.wandb``)."""

    def __init__(self, run_dir: Path, settings: dict | None = None, config: dict | None = None,
                 name: str | None = None, group: str | None = None, resuming: bool = False):
        """``resuming``: the run continues from a checkpoint in ``run_dir``, so it continues that run's W&B run and
        its metrics.jsonl (whose rows after the checkpoint ``rewind`` drops). Otherwise the run starts afresh here,
        from step 0 or from another run's checkpoint (ckpt_path), and its metrics.jsonl starts empty: no row of an
        earlier run in this directory passes for one of this run's."""
        for key in settings or {}:  # every key names a logger, `csv:` with no settings too
            if key not in BACKENDS:
                raise ConfigError(f"logger.{key}: no logger of that name (src/loggers.py's BACKENDS has "
                                  f"{', '.join(BACKENDS)})")
        settings = {key: value or {} for key, value in (settings or {}).items() if value is not False}  # false: off
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.backends = []
        try:  # first: a setting that fails leaves no open file or started run behind
            for key, value in settings.items():
                self.backends.append(BACKENDS[key](value, config or {}, name, group, Path(run_dir), resuming))
        except BaseException:
            for backend in self.backends:
                backend.finish({"status": "failed"})
            raise
        self._file = open(self.path, "a" if resuming else "w", encoding="utf-8")  # noqa: SIM115 (closed in finish)

    def relabel(self, strategy: str, name: str) -> None:
        """The runs' strategy and name once memory=auto has chosen (they start before the data is read)."""
        for backend in self.backends:
            backend.relabel(strategy, name)

    def log(self, metrics: dict, step: int) -> None:
        row = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        for backend in self.backends:
            backend.log(metrics, step)

    def rewind(self, step: int) -> None:
        """Drop the rows logged after ``step`` (a resumed run trains those steps again)."""
        self._file.close()
        lines = self.path.read_text(encoding="utf-8").splitlines()
        kept = []
        for line in lines:
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line)
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # a row cut short by the crash
        with atomic_path(self.path) as tmp:
            tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in finish)

    def log_samples(self, step: int, sources: list[str], references: list[str], hypotheses: list[str]) -> None:
        """Validation translations, for the loggers that show them (W&B's table)."""
        for backend in self.backends:
            backend.log_samples(step, sources, references, hypotheses)

    def finish(self, summary: dict) -> None:
        self._file.close()
        backends, self.backends = self.backends, []  # once, also when finish is called again
        for backend in backends:
            backend.finish(summary)


class NullLogger:
    """What ranks other than 0 log with under torchrun: nothing (rank 0 logs the reduced figures)."""

    def log(self, metrics: dict, step: int) -> None:
        pass

    def rewind(self, step: int) -> None:
        pass

    def log_samples(self, step: int, sources: list[str], references: list[str], hypotheses: list[str]) -> None:
        pass

    def finish(self, summary: dict) -> None:
        pass


def _jsonable(value) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True
