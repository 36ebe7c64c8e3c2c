"""A sweep's runs side by side, from local files only: ``python experiments/report.py <multirun dir>``.

Each job directory of the sweep holds ``summary.json`` (written whatever happened), ``metrics.jsonl``,
``config.yaml`` and Hydra's ``.hydra/overrides.yaml``. The report is a markdown table (strategy, effective
batch, peak memory by category, tokens/s, steps, validation and test BLEU, status) and a PNG: peak memory against
throughput, each point labelled with its run and BLEU, and the training loss curves. Failed and out-of-memory jobs
are rows of their own with the reason; a job killed before writing its summary is shown as such. Where the sweep
ran a setting with several seeds, a second table gives each such setting's BLEU over its seeds (mean, spread).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import statistics
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from omegaconf import OmegaConf

from .errors import DataError, UserError
from .fileio import atomic_path
from .loggers import run_name
from .memory import memory_strategy, shown_categories

log = logging.getLogger(__name__)

STATUS_TEXT = {"completed": "completed", "oom": "**out of memory**", "failed": "**failed**",
               "interrupted": "**interrupted**", None: "**no summary.json** (still running, or killed)"}


@dataclass
class Job:
    name: str  # the job's directory name (Hydra's job number)
    path: Path
    summary: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    overrides: list[str] = field(default_factory=list)
    metrics: list[dict] = field(default_factory=list)
    varying: frozenset[str] = frozenset()  # its overrides that other jobs of the sweep do not share
    log_error: str | None = None  # without a summary: the last error its log (Hydra's train.log) recorded
    earlier_summary: bool = False  # a sweep launched again: its summary.json is the earlier launch's, left out
    damaged: str | None = None  # a file of the job that does not read (left out of the figures): why
    started: bool = True  # False: a job of the sweep with no directory (the sweep stopped before it, or is running)

    @property
    def status(self) -> str | None:
        return self.summary.get("status")

    @property
    def strategy(self) -> str:
        if self.summary.get("strategy"):
            return self.summary["strategy"]
        try:
            return memory_strategy(self.config["memory"], self.config["data"].get("max_tokens")).label
        except (KeyError, TypeError, AttributeError, UserError):  # no usable config.yaml
            return "?"

    @property
    def label(self) -> str:
        """Strategy plus what else this job overrides: what tells the sweep's runs apart."""
        return run_name(self.strategy, [o for o in self.overrides if o in self.varying])

    @property
    def effective_batch(self) -> str:
        s, data = self.summary, self.config.get("data", {})
        max_tokens = s.get("max_tokens", data.get("max_tokens"))
        batch = s.get("batch_size") or data.get("batch_size")
        accum = (s.get("final_accum_steps") or s.get("accum_steps") or self.config.get("memory", {}).get("accum_steps")
                 or 1)
        if not all(isinstance(x, int | None) for x in (max_tokens, batch, accum)):
            return "?"  # a job that failed on a setting such as data.max_tokens=4k
        text = f"{max_tokens:,} tokens" if max_tokens else f"{batch} pairs" if batch else "?"
        if accum > 1:
            micro = f"{-(-max_tokens // accum):,} tokens" if max_tokens else -(-batch // accum) if batch else "?"
            # raised by out-of-memory back-offs: the steps before trained in fewer, larger micro-batches
            since = f" from step {backoffs[-1]['step']}" if (backoffs := s.get("oom_backoffs")) else ""
            text += f" ({accum} x {micro}{since})"
        world = s.get("world_size") or 1  # torchrun: a batch (or token budget) per rank in each optimizer step
        return f"{world} ranks x {text}" if world > 1 else text

    @property
    def train_rows(self) -> list[dict]:
        return [r for r in self.metrics if r.get("loss") is not None]


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON (line {e.lineno}): {e.msg}") from None
    if not isinstance(data, dict):
        raise DataError(f"{path}: a JSON {type(data).__name__}, not the object a run writes")
    return data


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    rows = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            # the last line of a killed run may be cut short; anywhere else it is damage worth naming
            if i != len(lines):
                raise DataError(f"{path}, line {i}: not valid JSON") from None
    return rows


def _read_yaml(path: Path):
    if not path.exists():
        return None
    try:
        return OmegaConf.to_container(OmegaConf.load(path))
    except Exception as e:
        raise DataError(f"{path}: not valid YAML: {str(e).splitlines()[0]}") from None


def load_sweep(sweep_dir: str | Path, latest_launch: bool = False) -> list[Job]:
    """Every job of a multirun directory (or a single run directory), in job order. ``latest_launch``: at the end
    of a sweep launched again into its directory (the callbacks), only the jobs of this launch, told by their
    files' times against its ``multirun.yaml`` (not from a report run later on a copy, whose times are the copy's)."""
    root = Path(sweep_dir)
    if not root.is_dir():
        raise DataError(f"{root}: no such directory")
    candidates = [root] if _is_job(root) else [p for p in root.iterdir() if p.is_dir() and _is_job(p)]
    if not candidates:
        raise DataError(f"{root}: no runs found (expected job directories with summary.json or .hydra/)")
    present = {p.name for p in candidates}  # (an earlier launch's job left out below is not one never started)
    launched = _launched(root) if latest_launch else None
    if launched is not None:  # a sweep launched again into its directory: its earlier launch's jobs are not its own
        earlier = [p for p in candidates if _newest(p, ".hydra/overrides.yaml", ".hydra/config.yaml", "summary.json")
                   < launched]
        if len(earlier) == len(candidates):
            raise DataError(f"{root}: no job of the sweep's latest launch wrote anything (its multirun.yaml is newer "
                            f"than the {len(earlier)} job directories there, an earlier launch's)")
        if earlier:
            log.warning("%s: %d job director%s of an earlier launch of the sweep left out (%s)", root, len(earlier),
                        "y" if len(earlier) == 1 else "ies", ", ".join(sorted(p.name for p in earlier)))
            candidates = [p for p in candidates if p not in earlier]
    hydra = _multirun_hydra(root)
    jobs = [Job(str(number), root / str(number), config=_composed(overrides, hydra), overrides=overrides,
                started=False)
            for number, overrides in enumerate(_sweep_jobs(hydra)) if str(number) not in present]
    for path in candidates:
        try:
            jobs.append(_load_job(path, launched))
        except DataError as e:  # one job's damaged file: the others are still reported
            log.warning("job %s left out of the figures: %s", path.name, e)
            overrides = []
            with contextlib.suppress(DataError):
                overrides = _read_yaml(path / ".hydra" / "overrides.yaml") or []
            jobs.append(Job(path.name, path, overrides=list(overrides), damaged=str(e)))
    jobs.sort(key=lambda j: (not j.name.isdigit(), int(j.name) if j.name.isdigit() else 0, j.name))  # job order
    # the overrides that differ between jobs are what names them; the ones they share are the sweep's setting
    shared = shared_overrides(jobs)
    for job in jobs:
        job.varying = frozenset(o for o in job.overrides if o not in shared)
    return jobs


def _multirun_hydra(root: Path) -> dict:
    """The ``hydra`` node of the sweep's ``multirun.yaml`` in ``root``: how it was launched. Empty where there is
    none, or it does not read."""
    with contextlib.suppress(DataError):
        return (_read_yaml(root / "multirun.yaml") or {}).get("hydra") or {}
    return {}


def _sweep_jobs(hydra: dict) -> list[list[str]]:
    """Each job's overrides, as the sweep (its ``multirun.yaml``'s ``hydra`` node) was launched with them: a
    preset's ``hydra.sweeper.params``, then the command line's, as Hydra's basic sweeper combines them; less the one
    train.py adds to a saved config run again, as a job's own record has it (``hydra_job``). Empty where that
    cannot be read (no multirun.yaml, another sweeper's)."""
    from .config_check import sweep_jobs, without_project_hydra

    try:
        if not str((hydra.get("sweeper") or {}).get("_target_", "")).endswith(".BasicSweeper"):
            return []
        params = [f"{key}={value}" for key, value in ((hydra.get("sweeper") or {}).get("params") or {}).items()]
        jobs = sweep_jobs([*params, *((hydra.get("overrides") or {}).get("task") or [])], True)
        return [without_project_hydra(job) for job in jobs]
    except Exception:  # (a sweep of another version of the configs, say: its jobs are still listed as found)
        return []


def _composed(overrides: list[str], hydra: dict) -> dict:
    """The config a job not started would run with (its strategy and batch, for its row), from the sweep's own
    primary config and config folders (``hydra``: its multirun.yaml's): a saved ``.hydra/config.yaml`` run again,
    or conf/train.yaml with a ``--config-dir`` of one's own. Empty where it does not compose here."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from .config_check import _PRIMARY

    name = (hydra.get("job") or {}).get("config_name") or _PRIMARY[1]
    sources = ((hydra.get("runtime") or {}).get("config_sources")) or []

    def folders(provider: str) -> list[str]:  # ("main": the primary config's; "command-line": --config-dir's)
        return [s["path"] for s in sources if s.get("provider") == provider and s.get("schema") == "file"]

    main = next(iter(folders("main")), None)
    if main is None or not Path(main).is_dir():  # a sweep of conf/train.yaml reported elsewhere: this checkout's
        main = str(_PRIMARY[0]) if name == _PRIMARY[1] else None
    extra = [f"file://{path}" for path in folders("command-line")]
    try:  # in train.py's process (a sweep stopped by a signal) Hydra is initialized, with the sweep's config folders
        if GlobalHydra.instance().is_initialized():
            cfg = compose(config_name=name, overrides=overrides)
        elif main is None:
            return {}
        else:
            with initialize_config_dir(config_dir=main, version_base="1.3"):
                cfg = compose(config_name=name,
                              overrides=[*overrides, *([f"hydra.searchpath=[{','.join(extra)}]"] if extra else [])])
        return OmegaConf.to_container(cfg, resolve=False)
    except Exception:
        return {}


def _load_job(path: Path, launched: float | None) -> Job:
    summary = _read_json(path / "summary.json")
    earlier_summary = launched is not None and bool(summary) and _newest(path, "summary.json") < launched
    if earlier_summary:
        summary = {}  # the earlier launch's: this one was refused, or killed, before it wrote its own
    metrics = _read_jsonl(path / "metrics.jsonl")
    if launched is not None and metrics and _newest(path, "metrics.jsonl") < launched:
        metrics = []  # the earlier launch's rows: this job logged none
    overrides = summary.get("overrides") or _read_yaml(path / ".hydra" / "overrides.yaml") or []
    config = _read_yaml(path / "config.yaml") or _read_yaml(path / ".hydra" / "config.yaml") or {}
    # e.g. a resume refused before the run began, which leaves the directory as it was
    log_error = _last_logged_error(_job_log(path), launched) if not summary else None
    return Job(path.name, path, summary, config, list(overrides), metrics, log_error=log_error,
               earlier_summary=earlier_summary)


def _job_log(path: Path) -> Path:
    """A job's log file, which Hydra names after the job: train.log, or myjob.log with hydra.job.name=myjob."""
    hydra = (_read_yaml(path / ".hydra" / "hydra.yaml") or {}).get("hydra") or {}
    return path / f"{(hydra.get('job') or {}).get('name') or 'train'}.log"


def _last_logged_error(log_file: Path, since: float | None = None) -> str | None:
    """The last ``[ERROR]`` line of a job's log, without its time and logger (``error: `` taken off too); with
    ``since``, of the lines logged from then on (Hydra appends a launch's lines to the earlier launch's)."""
    try:
        lines = log_file.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    errors = []
    for line in lines:
        if "][ERROR] - " not in line:
            continue
        try:  # [2026-12-03 08:51:31,860][train][ERROR] - ..., in local time
            logged = datetime.strptime(line[1:20], "%Y-%m-%d %H:%M:%S").timestamp()
        except ValueError:
            logged = None
        if since is None or logged is None or logged >= int(since):
            errors.append(line.split("][ERROR] - ", 1)[1])
    return errors[-1].removeprefix("error: ") if errors else None


def shared_overrides(jobs: list[Job]) -> set[str]:
    return set.intersection(*(set(j.overrides) for j in jobs))


def _launched(root: Path) -> float | None:
    """When the sweep in ``root`` was last launched: Hydra writes ``multirun.yaml`` there as it starts the jobs
    (less a second, for file systems that keep coarse times). None for a directory that is no sweep's."""
    marker = root / "multirun.yaml"
    return marker.stat().st_mtime - 1.0 if marker.is_file() else None


def _newest(path: Path, *files: str) -> float:
    """The last time any of these files of a job was written (0 where none is)."""
    return max((f.stat().st_mtime for f in (path / name for name in files) if f.is_file()), default=0.0)


def _is_job(path: Path) -> bool:
    return (path / "summary.json").exists() or (path / ".hydra").is_dir()


def _fmt(x, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    if isinstance(x, (int, float)):
        return f"{x:,.{digits}f}"
    return str(x)


def evaluated_on(summary: dict) -> str:
    """What a run's BLEU scores were measured on where that is not the whole validation and test sets; "" where
    it is."""
    pairs = (summary.get("eval_pairs") or {}).get("test")
    if summary.get("overfit_batches"):
        return f"on the {pairs} training pairs it overfit (trainer.overfit_batches)"
    if pairs is not None and pairs < (summary.get("sentences") or {}).get("test", pairs):
        return f"on the first {pairs} pairs (trainer.limit_eval)"
    return ""


def _status(job: Job) -> str:
    if not job.started:
        return "**not started** (the sweep stopped before it, or has not reached it yet)"
    if job.damaged:
        return f"**damaged**: {job.damaged[:160]}"
    text = STATUS_TEXT.get(job.status, job.status)
    if job.status is None and job.log_error:  # it stopped before its run began, leaving its directory as it was
        text = "**no summary.json**; its log's last error"
    if job.earlier_summary:
        text = text.replace("**no summary.json**", "**no summary.json of this launch** (the earlier launch's kept)")
    scored = job.summary.get("valid_bleu") is not None or job.summary.get("test_bleu") is not None
    if scored and (scope := evaluated_on(job.summary)):  # (a job that failed before scoring has none)
        text += f"; BLEU {scope}"
    if job.status is None and job.train_rows:
        text += f", logged up to step {job.train_rows[-1]['step']}"
    if (backoffs := job.summary.get("oom_backoffs")) and job.status != "oom":  # an oom error counts them itself
        text += f" after {len(backoffs)} out-of-memory back-off(s)"
    error = job.summary.get("error") or job.log_error
    if error:  # its first 120 characters, on the row's one line (an error names every problem, a line each)
        text += ": " + " / ".join(line.strip() for line in error.splitlines() if line.strip())[:120]
    return text


def _short(text: str, most: int = 40) -> str:
    """A label as the plot shows it: long ones cut (the table beside it has them whole), so that they stay in their
    panel."""
    return text if len(text) <= most else text[: most - 1] + "…"


def _cell(text: str) -> str:
    """Text as one cell of a markdown table row: a ``|`` in it (an override's value, an error) escaped."""
    return text.replace("|", "\\|")


def _plain(text: str) -> str:
    """Text as matplotlib shows it literally: a pair of ``$`` in it would start mathtext (or fail to parse)."""
    return text.replace("$", r"\$")


def _markdown(head: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
                      *("| " + " | ".join(row) + " |" for row in rows)]) + "\n"


def markdown_table(jobs: list[Job]) -> str:
    splits = [j.summary.get("peak_memory_split_mb") or {} for j in jobs]
    cats = shown_categories(splits) if any(splits) else ()  # where the tracker counted
    reserved = any(j.summary.get("peak_reserved_mb") for j in jobs)
    mfu = any(j.summary.get("mfu") for j in jobs)  # runs given trainer.peak_tflops
    head = ["job", "run", "effective batch", "peak memory (MiB)", *cats, *(["CUDA reserved"] if reserved else []),
            "tokens/s", *(["MFU"] if mfu else []), "steps", "valid BLEU", "test BLEU", "status"]
    rows = []
    for j in jobs:
        s, split = j.summary, j.summary.get("peak_memory_split_mb") or {}
        row = [j.name, _cell(j.label), j.effective_batch, _fmt(s.get("peak_memory_mb")), *(_fmt(split.get(c)) for c in cats),
               *([_fmt(s.get("peak_reserved_mb"))] if reserved else []), _fmt(s.get("tokens_per_s"), 0),
               *([f"{s['mfu']:.1%}" if s.get("mfu") else _fmt(None)] if mfu else []), _fmt(s.get("steps"), 0),
               _fmt(s.get("valid_bleu"), 2), _fmt(s.get("test_bleu"), 2), _cell(_status(j))]
        rows.append(row)
    return _markdown(head, rows)


def _setting(job: Job) -> tuple[str, str | None]:
    """The job's run without its seed, and the seed where the sweep varies it (else the run's label, None)."""
    seed = next((o.partition("=")[2] for o in job.varying if o.partition("=")[0] == "seed"), None)
    if seed is None:
        return job.label, None
    return run_name(job.strategy, [o for o in job.overrides if o in job.varying and o.partition("=")[0] != "seed"]), seed


def across_seeds(jobs: list[Job]) -> str:
    """Where the sweep ran a setting with several seeds (``-m memory=none,truncate seed=1,2,3``): a row for each
    such setting, over its completed runs with a test BLEU: the seeds, test BLEU's mean, sample standard
    deviation and range, valid BLEU's mean, and the mean peak memory and tokens/s. "" where no setting has two.
    A BLEU gap between settings within their spread is the seed's, not the setting's."""
    settings: dict[str, list[tuple[str, Job]]] = {}
    for j in jobs:
        setting, seed = _setting(j)
        if seed is not None and j.status == "completed" and j.summary.get("test_bleu") is not None:
            settings.setdefault(setting, []).append((seed, j))

    def mean(runs: list[tuple[str, Job]], key: str) -> float | None:
        values = [j.summary[key] for _, j in runs if j.summary.get(key) is not None]
        return statistics.fmean(values) if values else None

    head = ["run", "seeds", "test BLEU mean", "sd", "min", "max", "valid BLEU mean", "peak memory (MiB)", "tokens/s"]
    rows = []
    for setting, runs in settings.items():
        if len(runs) < 2:
            continue
        test = [j.summary["test_bleu"] for _, j in runs]
        row = [_cell(setting), ", ".join(seed for seed, _ in runs), _fmt(statistics.fmean(test), 2),
               _fmt(statistics.stdev(test), 2), _fmt(min(test), 2), _fmt(max(test), 2),
               _fmt(mean(runs, "valid_bleu"), 2), _fmt(mean(runs, "peak_memory_mb")), _fmt(mean(runs, "tokens_per_s"), 0)]
        rows.append(row)
    if not rows:
        return ""
    return ("Across seeds (each setting's completed runs; sd: the sample standard deviation; a BLEU gap between "
            "settings within their spread is the seed's):\n\n" + _markdown(head, rows))


def plot(jobs: list[Job], path: Path) -> None:
    """Peak memory against throughput (a point per finished job, labelled with its run and test BLEU; the jobs of
    a run over several seeds, or of one run repeated, in one colour with one label: their BLEU's mean and
    standard deviation), and loss curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_mem, ax_loss) = plt.subplots(1, 2, figsize=(13, 5.2))
    settings = {j.name: _setting(j)[0] for j in jobs}  # a run's seeds share its colour and its one label
    order = list(dict.fromkeys(settings.values()))
    color = {j.name: f"C{order.index(settings[j.name]) % 10}" for j in jobs}  # the same in both panels
    # finished runs only: one that stopped early has figures too (what it reached), but not a run's
    done = [j for j in jobs if j.status == "completed" and j.summary.get("tokens_per_s") and j.summary.get("peak_memory_mb")]
    if done:
        x_max = max(j.summary["tokens_per_s"] for j in done) * 1.3
        y_max = max(j.summary["peak_memory_mb"] for j in done) * 1.2
        ax_mem.set_xlim(0, x_max)
        ax_mem.set_ylim(0, y_max)
    runs: dict[str, list[Job]] = {}
    for j in done:
        runs.setdefault(settings[j.name], []).append(j)
        ax_mem.scatter(j.summary["tokens_per_s"], j.summary["peak_memory_mb"], s=40, color=color[j.name])
    placed: list[tuple[float, float]] = []  # label positions, as fractions of the axes
    for setting, group in sorted(runs.items(), key=lambda r: statistics.fmean(j.summary["peak_memory_mb"] for j in r[1])):
        x = statistics.fmean(j.summary["tokens_per_s"] for j in group)  # a run of several seeds: their middle
        y = statistics.fmean(j.summary["peak_memory_mb"] for j in group)
        bleu = [b for j in group if (b := j.summary.get("test_bleu")) is not None]
        name = _short(setting) if len(group) == 1 else f"{_short(setting)} ({len(group)} runs)"
        score = (f": BLEU {bleu[0]:.2f}" if len(bleu) == 1 else
                 f": BLEU {statistics.fmean(bleu):.2f} ± {statistics.stdev(bleu):.2f}" if bleu else "")
        fx, fy = x / x_max, y / y_max
        dy = 0.02
        while any(abs(fx - px) < 0.25 and abs(fy + dy - py) < 0.045 for px, py in placed):
            dy += 0.045  # move the label up until it clears the ones already placed
        placed.append((fx, fy + dy))
        left = fx > 0.55  # a point on the right: its label to its left, inside the panel
        ax_mem.annotate(_plain(name + score), (x, y), xytext=(x + (-0.015 if left else 0.015) * x_max, y + dy * y_max),
                        fontsize=8, ha="right" if left else "left",
                        arrowprops={"arrowstyle": "-", "lw": 0.5, "color": "0.5"} if dy > 0.03 else None)
    broken = [j for j in jobs if j.status != "completed"]
    unplotted = [j for j in jobs if j.status == "completed" and j not in done]  # e.g. trainer.memory_every=null
    lines = []
    if broken:
        lines += ["not finished:", *(_short(f"{j.name} {_short(j.label)}: {_status(j).replace('**', '')}", 90)
                                     for j in broken)]
    if unplotted:
        lines += ["finished, not plotted:", *(f"{j.name} {_short(j.label)}: no " + " and no ".join(
            what for key, what in (("peak_memory_mb", "peak memory"), ("tokens_per_s", "tokens/s"))
            if not j.summary.get(key)) for j in unplotted)]
    if lines:
        ax_mem.text(0.02, 0.02, _plain("\n".join(lines)), transform=ax_mem.transAxes, fontsize=8, va="bottom",
                    color="tab:red")
    ax_mem.set_xlabel("training throughput (source + target tokens/s)")
    ax_mem.set_ylabel("peak memory (MiB)")
    ax_mem.set_title("memory against speed (test BLEU beside each run)")
    ax_mem.grid(alpha=0.3)

    for j in jobs:
        rows = j.train_rows
        if rows:
            style = "-" if j.status == "completed" else "--"
            ax_loss.plot([r["step"] for r in rows], [r["loss"] for r in rows], style, color=color[j.name],
                         marker="o" if len(rows) == 1 else None, label=_plain(f"{j.name} {_short(j.label)}"))  # a lone point shows
    ax_loss.set_xlabel("optimizer step")
    ax_loss.set_ylabel("training loss (label-smoothed, per target token)")
    ax_loss.set_title("loss curves (dashed: did not finish)")
    ax_loss.grid(alpha=0.3)
    if ax_loss.lines:
        ax_loss.legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def ran_on(jobs: list[Job]) -> str:
    """What the jobs ran on (device, torch, commit), once when they share it and per job when they do not: a
    sweep spread over a cluster's nodes may land on different cards, whose tokens/s do not compare."""
    def describe(summary: dict) -> str:
        env = summary["environment"]
        commit = env.get("git_commit")
        code = f"commit {commit[:7]}{' with local changes' if env.get('git_dirty') else ''}" if commit else "no git commit"
        card = f" as a {summary['gpu_gb']:g} GB card (trainer.gpu_gb)" if summary.get("gpu_gb") else ""
        return f"{env.get('device_name', '?')}{card}, torch {env.get('torch', '?')}, {code}"

    seen = {j.name: describe(j.summary) for j in jobs if j.summary.get("environment")}
    if not seen:
        return ""
    if len(set(seen.values())) == 1:
        return f"Ran on: {next(iter(seen.values()))}\n\n"
    return "Ran on:\n\n" + "".join(f"- job {name}: {text}\n" for name, text in seen.items()) + "\n"


def next_step(jobs: list[Job]) -> str:
    """Where a sweep ran on the CPU: its peaks are those of the batches it trained, not a GPU's worst case."""
    if not any(str(j.summary.get("device", "")).startswith("cpu") for j in jobs):
        return ""
    return ("\nOn the CPU, each peak is the tracked tensor memory of the batches trained. For a GPU, plan the worst-case "
            "batch of the same overrides with `python plan.py -m <overrides> plan.gpu_gb=<card>`, or train with "
            "`memory=auto memory.budget_gb=<card>`.\n")


def write_report(sweep_dir: str | Path, out_dir: str | Path | None = None,
                 latest_launch: bool = False) -> tuple[Path, Path, str]:
    """Writes ``report.md`` and ``report.png`` into ``out_dir`` (default: the sweep directory); returns their
    paths and the report's tables (each job's, and where it ran a setting with several seeds, each setting's)."""
    jobs = load_sweep(sweep_dir, latest_launch)
    out = Path(out_dir) if out_dir is not None else Path(sweep_dir)
    if all(j.earlier_summary for j in jobs) and (out / "report.md").exists():
        raise DataError(f"{sweep_dir}: no job of this launch wrote a summary.json (each earlier one is kept), so "
                        f"{out / 'report.md'} stays the earlier launch's report")
    if any(p.exists() and not p.is_dir() for p in (out, *out.parents)):
        raise DataError(f"--out {out}: not a directory (report.md and report.png go into one)")
    table = markdown_table(jobs)
    if seeds := across_seeds(jobs):
        table += "\n" + seeds
    shared = sorted(shared_overrides(jobs))
    counts = Counter("not started" if not j.started else "damaged" if j.damaged else j.status or "no summary"
                     for j in jobs)
    text = (f"# Sweep report: {Path(sweep_dir)}\n\n"
            f"{len(jobs)} jobs: " + ", ".join(f"{n} {k}" for k, n in counts.items()) + "\n\n"
            + (f"Shared overrides: `{' '.join(shared)}`\n\n" if shared else "")
            + ran_on(jobs)
            + table + next_step(jobs) + "\n![peak memory against throughput, and loss curves](report.png)\n")
    md, png = out / "report.md", out / "report.png"
    with atomic_path(md) as tmp:  # first: the table stands should the plot fail
        tmp.write_text(text, encoding="utf-8")
    plot(jobs, png)
    return md, png, table
