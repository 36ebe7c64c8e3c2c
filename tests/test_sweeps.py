"""Sweeps as a user runs them: `python train.py -m ...` logs one W&B run per job (read back with wandb's own
reader), a failing job is recorded and the others still run, `experiments/report.py` compares them, and the
experiment presets reproduce their loss curves."""

import json
import re
import shutil
import signal
import statistics
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from src.errors import ConfigError, DataError
from src.loggers import run_name
from src.report import load_sweep, write_report
from src.run import train

from .conftest import FAST, compose_config
from .helpers import ROOT, read_jsonl, read_wandb_run, run_cli

SENTINEL = "sentinel-api-key-0123456789abcdef0123456789abcdef"


def wandb_file(run_dir: Path) -> Path:
    files = list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    return files[0]


@pytest.mark.slow
def test_multirun_logs_one_complete_wandb_run_per_job(tmp_path, shared_cache):
    sweep = tmp_path / "sweep"
    proc = run_cli("train.py", "-m", "memory=none,amp,accum", "logger=wandb", "logger.wandb.samples=3", "tags=[t1,t2]",
                   *FAST, f"hydra.sweep.dir={sweep}", f"paths.cache_dir={shared_cache}",
                   env_extra={"WANDB_API_KEY": SENTINEL})
    assert proc.returncode == 0, proc.stderr[-3000:]

    for job, label in (("0", "none"), ("1", "amp"), ("2", "accum")):  # the README's sweep, and the baseline
        run_dir = sweep / job
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["strategy"] == label
        w = read_wandb_run(wandb_file(run_dir))

        # one run per job, grouped by the sweep, named by strategy and overrides, tagged from config
        run = w["run"]
        assert run.run_group == str(sweep) and run.job_type == "train"
        assert run.display_name == run_name(label, summary["overrides"])
        assert run.display_name.startswith(f"{label} ") and "model=tiny" in run.display_name
        assert "memory=" not in run.display_name
        assert list(run.tags) == ["t1", "t2"]

        # the fully resolved config, as plain data, and the strategy
        config = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"))
        assert {k: w["config"][k] for k in config} == config
        assert w["config"]["strategy"] == label and "${" not in json.dumps(w["config"])

        # every metrics.jsonl row at its optimizer step
        rows = read_jsonl(run_dir / "metrics.jsonl")
        train_rows = [r for r in rows if "loss" in r]
        logged = {h["_step"]: h for h in w["history"]}
        assert [r["step"] for r in train_rows] == [s for s in sorted(logged) if "loss" in logged[s]]
        for r in train_rows:
            assert logged[r["step"]]["loss"] == pytest.approx(r["loss"], rel=1e-12)

        # summaries derived by define_metric, and the run's own figures
        bleus = [r["valid_bleu"] for r in rows if "valid_bleu" in r]
        speeds = [r["tokens_per_s"] for r in train_rows]
        assert w["summary"]["valid_bleu"] == {"max": pytest.approx(max(bleus))}
        assert w["summary"]["peak_memory_mb"] == {"max": pytest.approx(max(r["peak_memory_mb"] for r in train_rows))}
        assert {m: (w["metrics"][m].summary.max, w["metrics"][m].summary.mean) for m in w["metrics"]} == {
            "valid_bleu": (True, False), "peak_memory_mb": (True, False), "tokens_per_s": (False, True)}
        # throughput's mean: the run's rate, as summary.json and the report have it, all its tokens over all its
        # training time (the windows' rates weighted by their time), not W&B's plain mean of the windows' rates
        assert w["summary"]["tokens_per_s"] == {"mean": summary["tokens_per_s"]}
        assert summary["tokens_per_s"] != pytest.approx(statistics.mean(speeds))
        assert summary["tokens_per_s"] == pytest.approx(
            sum(r["src_tokens"] + r["tgt_tokens"] for r in train_rows) / sum(r["window_s"] for r in train_rows),
            rel=1e-3)
        assert w["summary"]["test_bleu"] == pytest.approx(summary["test_bleu"])
        assert w["summary"]["status"] == "completed" and w["exit_code"] == 0

        # sample translations, a table per validation
        tables = sorted((run_dir / "wandb").glob("offline-run-*/files/media/table/valid_samples_*.table.json"))
        assert len(tables) == len(bleus) == 2
        table = json.loads(tables[-1].read_text())
        assert table["columns"] == ["step", "source", "reference", "hypothesis"] and len(table["data"]) == 3

    # the API key is never written anywhere
    for path in sweep.rglob("*"):
        if path.is_file():
            assert SENTINEL.encode() not in path.read_bytes(), path


@pytest.fixture(scope="module")
def failing_sweep(tmp_path_factory, shared_cache) -> tuple[Path, object]:
    """A sweep of four jobs: one completes, one runs out of memory, one raises, one has a bad setting."""
    tmp = tmp_path_factory.mktemp("failing")
    sweep = tmp / "sweep"
    proc = run_cli("train.py", "-m", "fault.kind=null,oom,error,bogus", "fault.at_step=3", "fault.times=10",
                   "logger=wandb", *FAST,
                   f"hydra.sweep.dir={sweep}", f"paths.cache_dir={shared_cache}")
    return sweep, proc


@pytest.mark.slow
def test_failing_jobs_are_recorded_and_the_sweep_goes_on(failing_sweep):
    sweep, proc = failing_sweep
    assert proc.returncode == 0, proc.stderr[-3000:]  # failures do not fail the sweep unless asked to
    summaries = [json.loads((sweep / j / "summary.json").read_text()) for j in "0123"]
    assert [s["status"] for s in summaries] == ["completed", "oom", "failed", "failed"]
    assert summaries[0]["test_bleu"] is not None
    assert "after 3 back-off(s), the most memory.oom_retries=3 allows" in summaries[1]["error"]
    assert "Tried to allocate" in summaries[1]["error"]
    assert "injected failure" in summaries[2]["error"]
    assert summaries[3]["error"].startswith("fault.kind=bogus")
    # what the jobs that stopped in training had reached: two steps; the bad setting stopped before any
    for stopped in summaries[1:3]:
        assert stopped["steps"] == 2 and stopped["tokens_per_s"] > 0 and stopped["peak_memory_mb"] > 0
        assert stopped["peak_memory_split_mb"]["parameters"] > 0 and "test_bleu" not in stopped
    assert "steps" not in summaries[3]
    assert "3 sweep job(s) did not complete:" in proc.stderr
    assert f"job 1 ({sweep / '1'}): oom: out of memory at step 3" in proc.stderr
    for job, status in zip("0123", ("completed", "oom", "failed", "failed")):
        w = read_wandb_run(wandb_file(sweep / job))
        assert w["summary"]["status"] == status
        assert w["exit_code"] == (0 if status == "completed" else 1)
        if job in "12":  # stopped in training: W&B has what they had reached too
            assert w["summary"]["steps"] == 2 and w["summary"]["environment"]["torch"] == torch.__version__
    # the out-of-memory job logged its steps before the failure
    assert [r["step"] for r in read_jsonl(sweep / "1" / "metrics.jsonl") if "loss" in r] == [2]
    assert [r["accum_steps"] for r in read_jsonl(sweep / "1" / "metrics.jsonl") if "oom_backoffs" in r] == [2, 4, 8]


@pytest.mark.slow
def test_report_lists_every_job_and_draws_a_png(failing_sweep, tmp_path):
    sweep, sweep_proc = failing_sweep
    proc = run_cli("experiments/report.py", str(sweep), "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = markdown_rows((tmp_path / "report.md").read_text())
    assert [r.split(" | ")[0] for r in rows] == ["| 0", "| 1", "| 2", "| 3"]
    assert rows[0].endswith("| completed |")
    assert "**out of memory**: out of memory at step 3" in rows[1] and "after 3 back-off(s)" in rows[1]
    assert "| 2 | – | – | **out of memory**" in rows[1]  # its steps; no BLEU
    assert "**failed**: RuntimeError" in rows[2]
    assert "fault.kind=bogus" in rows[3]
    assert "fault.kind=oom" in rows[1]  # runs are named by what differs between the jobs
    from matplotlib import image  # here: a machine without matplotlib (a lent GPU's) still runs the other tests

    png = image.imread(tmp_path / "report.png")
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.shape[0] > 300 and png.shape[1] > 600
    # what the jobs ran on, said once since they share it
    env = json.loads((sweep / "0" / "summary.json").read_text())["environment"]
    assert f"Ran on: {env['device_name']}, torch {torch.__version__}, commit {env['git_commit'][:7]}" in (
        tmp_path / "report.md").read_text()
    # and, run on the CPU, where a GPU's worst case is planned
    assert "For a GPU, plan the worst-case batch of the same overrides with `python plan.py -m" in (
        tmp_path / "report.md").read_text()
    # The sweep itself wrote the same report into its directory when its last job ended, and printed the table.
    assert (sweep / "report.md").read_text() == (tmp_path / "report.md").read_text()
    assert (sweep / "report.png").is_file() and all(row in sweep_proc.stdout for row in rows)


def test_report_rows_stay_one_line_whatever_the_labels_and_errors_hold(tmp_path):
    """An error naming several problems (a line each), a | or a pair of $ in an override's value: each job is
    one row of the table's columns, and the plot is drawn (the $ pair stopped it, and with it the report). A job
    that failed on a setting of the wrong type (data.max_tokens=4k: its default is null, so any value composes)
    has its effective batch unknown (formatting it stopped the report)."""
    sweep = tmp_path / "sweep"
    for job, tag in (("0", "a|b"), ("1", "$x^$")):
        d = sweep / job
        (d / ".hydra").mkdir(parents=True)
        (d / ".hydra" / "overrides.yaml").write_text(f"- data.root={tag}\n")  # in the run's name (tags are not)
        summary = {"status": "completed", "strategy": "none", "tokens_per_s": 10.0, "peak_memory_mb": 1.0}
        if job == "0":
            summary = {"status": "failed", "strategy": "none",
                       "error": "data/train.de: file not found\ndata/valid.de: file not found"}
            (d / "config.yaml").write_text("data: {max_tokens: 4k, batch_size: 8}\nmemory: {accum_steps: 1}\n")
        (d / "summary.json").write_text(json.dumps(summary))
        (d / "metrics.jsonl").write_text('{"step": 2, "loss": 5.0}\n')
    md, png, table = write_report(sweep)
    lines = [line for line in table.splitlines() if line.startswith("| ")]
    cells = [len(re.findall(r"(?<!\\)\|", line)) for line in lines]  # the cell separators: unescaped |
    assert len(lines) == 3 and cells[1:] == [cells[0], cells[0]] and r"data.root=a\|b" in lines[1]
    assert "file not found / data/valid.de: file not found" in lines[1]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_each_figure_of_the_report_is_under_its_own_header(tmp_path):
    """A job whose every figure differs: each cell of its row is under the header that names it (valid and test
    BLEU swapped passed every other test)."""
    d = tmp_path / "sweep" / "0"
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text("- memory=amp\n")
    (d / "config.yaml").write_text("data: {batch_size: 32}\nmemory: {accum_steps: 2}\n")
    split = dict(zip(("parameters", "gradients", "optimizer", "activations", "logits", "backward"),
                     (1.0, 2.0, 3.0, 4.0, 5.0, 6.0), strict=True))
    (d / "summary.json").write_text(json.dumps({
        "status": "completed", "strategy": "amp", "peak_memory_mb": 123.4, "peak_memory_split_mb": split,
        "peak_reserved_mb": 150.5, "tokens_per_s": 4567.0, "mfu": 0.25, "steps": 89, "valid_bleu": 12.34,
        "test_bleu": 56.78}))
    (d / "metrics.jsonl").write_text('{"step": 2, "loss": 5.0}\n')
    _, _, table = write_report(tmp_path / "sweep")
    head, _, row = (line.strip("| ").split(" | ") for line in table.splitlines() if line.startswith("|"))
    cells = dict(zip(head, row, strict=True))
    assert cells == {"job": "0", "run": "amp", "effective batch": "32 pairs (2 x 16)", "peak memory (MiB)": "123.4",
                     **{name: f"{mib:.1f}" for name, mib in split.items()}, "CUDA reserved": "150.5",
                     "tokens/s": "4,567", "MFU": "25.0%", "steps": "89", "valid BLEU": "12.34",
                     "test BLEU": "56.78", "status": "completed"}


def test_a_sweep_of_twelve_jobs_is_reported_in_job_order(tmp_path):
    """Jobs 0 to 11 come in their numbers' order, not as text sorts them (0, 1, 10, 11, 2, ...)."""
    for job in range(12):
        d = tmp_path / "sweep" / str(job)
        (d / ".hydra").mkdir(parents=True)
        (d / ".hydra" / "overrides.yaml").write_text(f"- seed={job}\n")
        (d / "summary.json").write_text(json.dumps({"status": "completed", "strategy": "none", "peak_memory_mb": 1.0}))
        (d / "metrics.jsonl").write_text('{"step": 2, "loss": 5.0}\n')
    _, _, table = write_report(tmp_path / "sweep")
    rows = [line.strip("| ").split(" | ")[0] for line in table.splitlines() if line.startswith("| ")][1:]
    assert rows == [str(job) for job in range(12)]


def test_a_sweep_over_seeds_reports_each_settings_bleu_across_them(tmp_path, monkeypatch):
    """``-m memory=none,truncate seed=1,2,3``: below the jobs' table, a row for each setting over its completed
    seeds (a failed one left out), with test BLEU's mean, sample standard deviation and range; a setting run
    with one seed has no row, and a sweep without seeds has no such table. The plot labels each setting once."""
    from matplotlib.axes import Axes

    labels = []
    real_annotate = Axes.annotate
    monkeypatch.setattr(Axes, "annotate", lambda self, text, *a, **k: labels.append(text) or real_annotate(
        self, text, *a, **k))
    sweep = tmp_path / "sweep"
    runs = [("none", 1, 40.0), ("none", 2, 50.0), ("none", 3, 60.0),
            ("truncate", 1, 57.0), ("truncate", 2, 59.0), ("truncate", 3, None), ("amp", 1, 30.0)]
    for n, (memory, seed, bleu) in enumerate(runs):
        d = sweep / str(n)
        (d / ".hydra").mkdir(parents=True)
        (d / ".hydra" / "overrides.yaml").write_text(f"- memory={memory}\n- seed={seed}\n- model=tiny\n")
        summary = {"status": "failed", "strategy": memory, "error": "boom"} if bleu is None else {
            "status": "completed", "strategy": memory, "test_bleu": bleu, "valid_bleu": bleu - 1 - seed,
            "peak_memory_mb": 100.0 + seed, "tokens_per_s": 1000.0 * seed}
        (d / "summary.json").write_text(json.dumps(summary))
    md, _, table = write_report(sweep)
    assert "Across seeds" in md.read_text() and table in md.read_text()
    jobs, seeds = table.split("Across seeds")
    assert len(markdown_rows(jobs)) == len(runs)
    head, *rows = (line.strip("| ").split(" | ") for line in markdown_rows(seeds))
    by_run = {row[0]: dict(zip(head, row, strict=True)) for row in rows}
    assert set(by_run) == {"none", "truncate"}  # amp: one seed; truncate: seed 3 failed
    assert by_run["none"] == {"run": "none", "seeds": "1, 2, 3", "test BLEU mean": "50.00", "sd": "10.00",
                              "min": "40.00", "max": "60.00", "valid BLEU mean": "47.00",
                              "peak memory (MiB)": "102.0", "tokens/s": "2,000"}
    assert by_run["truncate"]["seeds"] == "1, 2" and by_run["truncate"]["test BLEU mean"] == "58.00"
    assert by_run["truncate"]["sd"] == f"{statistics.stdev([57.0, 59.0]):.2f}" == "1.41"
    assert sorted(labels) == ["amp: BLEU 30.00", "none (3 runs): BLEU 50.00 ± 10.00",
                              "truncate (2 runs): BLEU 58.00 ± 1.41"]
    for n in range(3, len(runs)):
        shutil.rmtree(sweep / str(n))
    for n in range(3):  # three settings with a seed each: none to compare across seeds
        (sweep / str(n) / ".hydra" / "overrides.yaml").write_text(f"- seed={n + 1}\n- trainer.max_steps={n + 5}\n")
    assert "Across seeds" not in write_report(sweep)[2] and "Across seeds" not in (sweep / "report.md").read_text()


def test_a_job_refused_before_its_run_began_is_reported_with_its_logged_error(tmp_path):
    """A sweep launched again into its directory: job 0 is refused before its run begins (its directory holds
    the earlier launch's checkpoints), which leaves the directory as it was. Its row gave the earlier launch's
    logged steps and "still running, or killed"; it gives the error its log recorded in this launch. Job 1 was
    killed: only an error of the earlier launch is in its log, which is not this launch's."""
    import os
    import time

    from src.callbacks import SweepStatus, outcome

    sweep = tmp_path / "sweep"
    earlier, now = time.time() - 100, time.time()
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(earlier))
    for job in ("0", "1"):
        d = sweep / job
        (d / ".hydra").mkdir(parents=True)
        (d / ".hydra" / "overrides.yaml").write_text("- optim.lr=0.0002\n")
        for name, text in (("summary.json", '{"status": "completed", "strategy": "none"}'),
                           ("metrics.jsonl", '{"step": 4, "loss": 4.0}\n')):
            (d / name).write_text(text)
            os.utime(d / name, (earlier, earlier))
        log = f"[{stamp},000][train][ERROR] - error: an earlier launch's error\n"
        if job == "0":
            log += f"[{time.strftime('%Y-%m-%d %H:%M:%S')},000][train][ERROR] - error: {d}/checkpoints holds an earlier run's checkpoints\n"
            (d / ".hydra" / "hydra.yaml").write_text("hydra:\n  job:\n    name: myjob\n")  # hydra.job.name=myjob
        (d / ("myjob.log" if job == "0" else "train.log")).write_text(log)
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    os.utime(sweep / "multirun.yaml", (now - 5, now - 5))
    jobs = load_sweep(sweep, latest_launch=True)
    assert [j.status for j in jobs] == [None, None] and [j.train_rows for j in jobs] == [[], []]
    rows = markdown_rows(write_report(sweep, latest_launch=True)[2])
    assert (f"**no summary.json of this launch** (the earlier launch's kept); its log's last error: {sweep}/0/"
            "checkpoints holds an earlier run's") in rows[0]
    assert "(still running, or killed)" in rows[1] and "earlier launch's error" not in rows[1]
    SweepStatus().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}}))
    failed, outcome.failed = outcome.failed, None  # (this process's state: no sweep ran)
    assert failed[0].endswith("holds an earlier run's checkpoints")
    assert failed[1].endswith("no summary.json of this launch")
    # the earlier launch's report stays: this launch's jobs wrote no summary over theirs (it blanked it)
    (sweep / "report.md").write_text("the earlier launch's report")
    with pytest.raises(DataError, match="no job of this launch wrote a summary.json .* stays the earlier launch's"):
        write_report(sweep, latest_launch=True)
    assert (sweep / "report.md").read_text() == "the earlier launch's report"
    assert len(markdown_rows(write_report(sweep)[2])) == 2  # report.py: the jobs' newest files, both completed
    assert "completed" in (sweep / "report.md").read_text()


def test_report_shows_a_job_killed_before_its_summary(tmp_path):
    """A job killed outright (SIGKILL, node lost) leaves no summary.json: it is a row, not a gap."""
    sweep = tmp_path / "sweep"
    for job, status in (("0", "completed"), ("1", None), ("10", "oom")):
        d = sweep / job
        (d / ".hydra").mkdir(parents=True)
        (d / ".hydra" / "overrides.yaml").write_text(f"- memory=amp\n- trainer.max_steps={job}\n")
        (d / "config.yaml").write_text("memory: {amp: bf16, accum_steps: 2}\ndata: {batch_size: 8, max_tokens: null}\n")
        (d / "metrics.jsonl").write_text('{"step": 2, "loss": 5.0}\n{"step": 4, "loss": 4.5}\n{"step": 6, "lo')
        if status:  # job 0 was given trainer.peak_tflops: an MFU column, "–" for the others
            (d / "summary.json").write_text(json.dumps({"status": status, "strategy": "amp+accum",
                                                        "tokens_per_s": 10.0, "peak_memory_mb": 1.0,
                                                        "mfu": 0.1234 if job == "0" else None}))
    jobs = load_sweep(sweep)
    assert [j.name for j in jobs] == ["0", "1", "10"]  # numeric order
    assert [j.status for j in jobs] == ["completed", None, "oom"]
    assert jobs[1].strategy == "amp+accum" and jobs[1].effective_batch == "8 pairs (2 x 4)"
    assert [r["step"] for r in jobs[1].train_rows] == [2, 4]  # the line cut off by the kill is skipped
    md, png, table = write_report(sweep)
    assert "Ran on" not in md.read_text()  # summaries without an environment (written before it was recorded)
    for job, card in (("0", "NVIDIA A100-SXM4-80GB"), ("10", "Tesla V100-SXM2-32GB")):  # a mixed partition
        summary = json.loads((sweep / job / "summary.json").read_text())
        summary["environment"] = {"device_name": card, "torch": "2.13.0", "git_commit": "0123456789", "git_dirty": False}
        summary["gpu_gb"] = 12 if job == "0" else None  # job 0 trained as on a 12 GB card
        (sweep / job / "summary.json").write_text(json.dumps(summary))
    md, png, table = write_report(sweep)
    assert ("Ran on:\n\n- job 0: NVIDIA A100-SXM4-80GB as a 12 GB card (trainer.gpu_gb), torch 2.13.0, commit 0123456\n"
            "- job 10: Tesla V100-SXM2-32GB, torch 2.13.0, commit 0123456\n") in md.read_text()
    assert "| 1 | amp+accum trainer.max_steps=1 | 8 pairs (2 x 4) |" in table
    assert "| **no summary.json** (still running, or killed), logged up to step 4 |" in table
    assert md.exists() and png.exists()
    assert "| tokens/s | MFU | steps |" in table and "| 10 | 12.3% |" in table and "| 10 | – |" in table


def test_the_plot_names_unfinished_jobs_in_plain_text_and_draws_a_lone_point(tmp_path, monkeypatch):
    """The PNG's list of unfinished jobs carries no markdown (it read "no summary.json** (still running, ..."),
    a completed job without a peak (trainer.memory_every=null) is named, not left out, and a job that logged one
    row shows as a point (a line of one point draws nothing)."""
    import matplotlib.pyplot as plt

    from src.report import plot

    sweep = tmp_path / "sweep"
    for job, status, steps, peak in (("0", "completed", (2, 4), 1.0), ("1", "oom", (2,), 1.0),
                                     ("2", None, (2, 4), 1.0), ("3", "completed", (2, 4), None)):
        (sweep / job / ".hydra").mkdir(parents=True)
        (sweep / job / ".hydra" / "overrides.yaml").write_text("- memory=none\n")
        (sweep / job / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 5.0 - s / 10}) + "\n"
                                                           for s in steps))
        if status:
            (sweep / job / "summary.json").write_text(json.dumps({"status": status, "strategy": "none",
                                                                  "tokens_per_s": 10.0, "peak_memory_mb": peak}))
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    plot(load_sweep(sweep), tmp_path / "report.png")
    ax_mem, ax_loss = figures[0].axes
    text = "\n".join(t.get_text() for t in ax_mem.texts)
    assert "not finished:" in text and "out of memory" in text and "no summary.json (still running" in text
    assert "finished, not plotted:\n3 none: no peak memory" in text  # a completed run is not dropped unsaid
    assert "*" not in text
    # the finished job with both figures is the one point: the one that ran out of memory is not a result
    assert [c.get_offsets().tolist() for c in ax_mem.collections] == [[[10.0, 1.0]]]
    markers = {line.get_label(): line.get_marker() for line in ax_loss.lines}
    assert markers["1 none"] == "o" and markers["0 none"] in ("None", None, "")
    plt.close(figures[0])


def test_report_says_when_bleu_was_not_measured_on_the_whole_sets(tmp_path):
    sweep = tmp_path / "sweep"
    whole = {"sentences": {"test": 20}, "eval_pairs": {"valid": 20, "test": 20}}
    limited = {"sentences": {"test": 20}, "eval_pairs": {"valid": 16, "test": 16}}
    for job, extra in (("0", whole), ("1", limited),
                       ("2", {**whole, "eval_pairs": {"valid": 64, "test": 64}, "overfit_batches": 1}),
                       ("3", {**limited, "status": "failed", "test_bleu": None, "error": "RuntimeError: injected"})):
        (sweep / job).mkdir(parents=True)
        (sweep / job / "summary.json").write_text(json.dumps({"status": "completed", "strategy": "none",
                                                              "test_bleu": 1.0, **extra}))
    rows = markdown_rows(write_report(sweep)[2])
    assert rows[0].endswith("| completed |")
    assert rows[1].endswith("| completed; BLEU on the first 16 pairs (trainer.limit_eval) |")
    assert rows[2].endswith("| completed; BLEU on the 64 training pairs it overfit (trainer.overfit_batches) |")
    assert rows[3].endswith("| **failed**: RuntimeError: injected |")  # no BLEU measured: no scope of it
    (tmp_path / "afile").write_text("")
    for out in (tmp_path / "afile", tmp_path / "afile" / "sub"):
        with pytest.raises(DataError, match=r"^--out \S+: not a directory"):
            write_report(sweep, out)


def test_report_names_what_it_cannot_read(tmp_path):
    from src.errors import DataError

    with pytest.raises(DataError, match="no such directory"):
        load_sweep(tmp_path / "missing")
    with pytest.raises(DataError, match="no runs found"):
        load_sweep(tmp_path)
    # one job's damaged file: that job is shown as damaged, why, and the others are reported (the whole report
    # was refused)
    for job in "01":
        (tmp_path / job / ".hydra").mkdir(parents=True)
        (tmp_path / job / ".hydra" / "overrides.yaml").write_text(f"- seed={job}\n")
    (tmp_path / "1" / "summary.json").write_text(json.dumps({"status": "completed", "strategy": "none",
                                                             "tokens_per_s": 10.0, "peak_memory_mb": 1.0}))
    for damage, why in (("{not json", r"0/summary.json: not valid JSON \(line 1\)"),
                        ("[]", r"0/summary.json: a JSON list, not the object a run writes")):
        (tmp_path / "0" / "summary.json").write_text(damage)
        jobs = load_sweep(tmp_path)
        assert [j.status for j in jobs] == [None, "completed"] and re.search(why, jobs[0].damaged)
        rows = markdown_rows(write_report(tmp_path)[2])
        assert rows[0].startswith("| 0 | ? seed=0 |") and re.search(rf"\*\*damaged\*\*: .*{why}", rows[0])
        assert rows[1].startswith("| 1 | none seed=1 |") and rows[1].endswith("| completed |")
    assert "2 jobs: 1 damaged, 1 completed" in (tmp_path / "report.md").read_text()


@pytest.mark.slow
def test_fail_on_error_runs_every_job_then_exits_non_zero(tmp_path, shared_cache):
    sweep = tmp_path / "sweep"
    proc = run_cli("train.py", "-m", "fault.kind=error,null", "fail_on_error=true", *FAST, "trainer.max_steps=2",
                   "trainer.eval_every=2", f"hydra.sweep.dir={sweep}", f"paths.cache_dir={shared_cache}")
    assert proc.returncode == 1
    statuses = [json.loads((sweep / j / "summary.json").read_text())["status"] for j in "01"]
    assert statuses == ["failed", "completed"]


@pytest.mark.slow
def test_a_sweep_relaunched_with_other_jobs_does_not_resume_one_jobs_run_as_another(tmp_path, shared_cache):
    """memory=none,amp relaunched with trainer.resume=auto as memory=amp,none: job 0 (none's run) resumed as amp,
    with a warning, and its summary, report row and W&B run gave none's peak and tokens/s under the label amp.
    Each job is refused in one line, its directory as it was; relaunched with the same jobs, they resume. Relaunched
    without trainer.resume, each job is refused too, naming the setting that gives a sweep another directory (it
    named hydra.run.dir, which a multirun ignores)."""
    sweep = tmp_path / "sweep"
    common = [*FAST, "trainer.max_steps=2", "trainer.eval_every=2", f"hydra.sweep.dir={sweep}",
              f"paths.cache_dir={shared_cache}"]
    assert run_cli("train.py", "-m", "memory=none,amp", *common).returncode == 0
    before = [(sweep / j / "summary.json").read_text() for j in "01"]
    proc = run_cli("train.py", "-m", "memory=none,amp", *common)
    assert [(sweep / j / "summary.json").read_text() for j in "01"] == before
    assert proc.stderr.count("add trainer.resume=auto to continue that run, trainer.resume=never to start over (they "
                             "are removed), or set hydra.sweep.dir to a new directory") == 2, proc.stderr
    proc = run_cli("train.py", "-m", "memory=amp,none", "trainer.resume=auto", *common)
    assert [(sweep / j / "summary.json").read_text() for j in "01"] == before
    assert proc.stderr.count("(a sweep relaunched with another list of jobs gives a job's number to another job): "
                             "relaunch the sweep as it was, or into a new hydra.sweep.dir") == 2, proc.stderr
    assert "step_00000002.pt: this sweep job's earlier launch trained memory strategy none, and this launch gives " \
           "the job amp" in proc.stderr and f"(hydra.run.dir={sweep / '0'} trainer.resume=auto)" in proc.stderr
    # another learning rate, the same jobs: resumed (with check_resumable's warning), as a single run is
    proc = run_cli("train.py", "-m", "memory=none,amp", "trainer.resume=auto", "optim.lr=1e-4", *common)
    assert proc.returncode == 0 and "did not complete" not in proc.stderr, proc.stderr
    assert [json.loads((sweep / j / "summary.json").read_text())["strategy"] for j in "01"] == ["none", "amp"]


@pytest.mark.slow
def test_a_sweep_stopped_by_sigterm_reports_the_jobs_it_ran(tmp_path, shared_cache):
    """SIGTERM (a preemption) in a job of a sweep run in this process stops the sweep; the end-of-sweep callbacks
    then do not run, but the report is written, the stopped job listed as interrupted, and the later job as not
    started (it was left out: "2 jobs" of a sweep of 3)."""
    sweep = tmp_path / "sweep"
    proc = run_cli("train.py", "-m", "fault.kind=null,sigterm,null", "fault.at_step=2", *FAST, "trainer.max_steps=3",
                   "trainer.eval_every=3", f"hydra.sweep.dir={sweep}", f"paths.cache_dir={shared_cache}")
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-3000:]
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1"]  # the third job never started
    assert "sweep stopped at job 1; its report holds the jobs it ran" in proc.stdout + proc.stderr
    assert (f"SIGTERM at step 2: checkpoint written; continue with trainer.resume=auto and hydra.sweep.dir={sweep} "
            "(the same sweep command: its jobs resume, or start)") in proc.stdout + proc.stderr
    report = (sweep / "report.md").read_text()
    rows = markdown_rows(report)
    assert [r.split("|")[1].strip() for r in rows] == ["0", "1", "2"]
    assert "| completed |" in rows[0] and "interrupted" in rows[1]
    assert rows[2].startswith("| 2 | none fault.kind=null |") and "**not started**" in rows[2]
    assert "3 jobs: 1 completed, 1 interrupted, 1 not started" in report
    assert (sweep / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("preset", ["memory_sweep", "multi30k_small", "paper_base", "throughput_ref"])
def test_presets_pin_seed_and_tags(preset, tmp_path):
    extra = ["data.train_prefix=a", "data.valid_prefix=b", "data.test_prefix=c"] if preset == "paper_base" else []
    cfg = compose_config(f"experiment={preset}", *extra, run_dir=tmp_path)
    resolved = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    assert resolved["seed"] == 1234 and resolved["tags"] == [preset]


def test_paper_base_is_the_papers_recipe(tmp_path):
    cfg = compose_config("experiment=paper_base", run_dir=tmp_path)
    m, o = cfg.model, cfg.optim
    assert (m.encoder_layers, m.d_model, m.n_heads, m.d_ff, m.dropout) == (6, 512, 8, 2048, 0.1)
    assert m.attention_dropout == m.activation_dropout == 0.0  # section 5.4: residual and embedding dropout only
    assert o.name == "noam" and o.warmup_steps == 4000 and o.label_smoothing == 0.1 and list(o.betas) == [0.9, 0.98]
    assert cfg.data.max_tokens == 25000 and cfg.trainer.max_steps == 100_000 and cfg.memory.trim_vocab
    t = cfg.trainer  # section 6.1: beam size 4, length penalty 0.6, at most input length + 50
    assert (t.beam_size, t.length_penalty, t.max_len_a, t.max_len_b) == (4, 0.6, 1, 50)
    assert t.keep_last == 5  # the last five checkpoints, for translate.py to average


def test_memory_sweep_preset_sweeps_strategies_at_one_effective_batch(tmp_path):
    from hydra import compose, initialize_config_dir

    from .conftest import CONF

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["experiment=memory_sweep"], return_hydra_config=True)
    params = cfg.hydra.sweeper.params.memory
    assert params.split(",")[:3] == ["none", "amp", "accum"] and "[amp,accum]" in params
    assert "tokens" not in params  # a token budget would change the effective batch
    assert cfg.data.batch_size == 64 and cfg.data.max_tokens is None


@pytest.mark.slow
def test_a_preset_reproduces_its_loss_curve(tmp_path, shared_cache):
    """Same preset, same seed: the same loss curve, exactly; another seed gives another curve."""

    def curve(name: str, *overrides: str) -> list[tuple]:
        cfg = compose_config("experiment=memory_sweep", "logger=none", *FAST, "data.long_fraction=0.05",
                             "trainer.max_steps=6", "trainer.eval_every=6", *overrides,
                             run_dir=tmp_path / name, cache_dir=shared_cache)
        assert train(cfg)["status"] == "completed"
        rows = read_jsonl(tmp_path / name / "metrics.jsonl")
        return [(r["step"], r["loss"], r["grad_norm"]) for r in rows if "loss" in r]

    first = curve("a")
    assert curve("b") == first
    assert curve("c", "seed=99") != first


def run_record(run_dir: Path) -> tuple[list[tuple], dict, dict]:
    """What a run computed: its training rows (step, loss, grad_norm), its scores and its final weights."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    curve = [(r["step"], r["loss"], r["grad_norm"]) for r in rows if "loss" in r]
    summary = json.loads((run_dir / "summary.json").read_text())
    scores = {k: summary[k] for k in ("valid_bleu", "valid_chrf", "test_bleu", "test_chrf")}
    last = max((run_dir / "checkpoints").glob("step_*.pt"))
    return curve, scores, torch.load(last, weights_only=True)["model"]


def assert_same_run(a: Path, b: Path) -> None:
    (curve_a, scores_a, weights_a), (curve_b, scores_b, weights_b) = run_record(a), run_record(b)
    assert curve_a == curve_b and scores_a == scores_b
    assert weights_a.keys() == weights_b.keys() and all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)


@pytest.mark.slow
def test_a_sweeps_later_job_and_a_rerun_from_hydra_config_equal_the_run_alone(tmp_path, shared_cache):
    """Reproducible as labs rerun: a sweep's second job, which runs in the process after the first (memory=accum,
    with other batches, threads, autocast state), equals the same settings run alone, to the bit; and so does the
    run started again from its .hydra/config.yaml (the README's recipe), in outputs/runs/ as any run (Hydra's own
    settings put it in outputs/<date>/<time>), and a sweep of it, in outputs/multirun/ with its report (which
    Hydra's own settings left out). That sweep stopped by SIGTERM: its job not started is reported with the saved
    config's batch (not conf/train.yaml's 64 pairs, nor "?" for train.py's +hydra=default), offline too."""
    common = [*FAST, "trainer.threads=1", f"paths.cache_dir={shared_cache}"]
    sweep = tmp_path / "sweep"
    proc = run_cli("train.py", "-m", "memory=accum,none", *common, f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    alone = tmp_path / "alone"
    proc = run_cli("train.py", "memory=none", *common, f"hydra.run.dir={alone}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((sweep / "1" / "summary.json").read_text())["strategy"] == "none"
    assert_same_run(sweep / "1", alone)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = run_cli(str(ROOT / "train.py"), "--config-path", str(alone / ".hydra"), "--config-name", "config",
                   cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (rerun,) = (elsewhere / "outputs" / "runs").glob("*/*")
    assert_same_run(rerun, alone)
    assert json.loads((rerun / "summary.json").read_text())["overrides"] == []  # (not train.py's +hydra=default)
    proc = run_cli(str(ROOT / "train.py"), "-m", "--config-path", str(alone / ".hydra"), "--config-name", "config",
                   "trainer.threads=1", "fault.kind=null,sigterm,null", "fault.at_step=1", cwd=elsewhere)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-3000:]
    (swept,) = (elsewhere / "outputs" / "multirun").glob("*/*")
    rows = markdown_rows((swept / "report.md").read_text())
    assert rows[0].startswith("| 0 | none fault.kind=null | 16 pairs |") and "| completed |" in rows[0]
    assert rows[2].startswith("| 2 | none fault.kind=null | 16 pairs |") and "**not started**" in rows[2]
    assert load_sweep(swept)[2].config["data"]["batch_size"] == 16  # offline (experiments/report.py), as in train.py
    assert_same_run(swept / "0", alone)

    # the run's own config.yaml fixes its directory: said, and refused before anything of the run is touched
    before = {f: f.stat().st_mtime_ns for f in (alone / "checkpoints").iterdir()}
    proc = run_cli("train.py", "--config-path", str(alone), "--config-name", "config", f"hydra.run.dir={tmp_path / 'x'}")
    said = proc.stdout + proc.stderr
    assert proc.returncode == 1
    assert f"this run writes into paths.output_dir={alone}, not into Hydra's run directory {tmp_path / 'x'}" in said
    assert "holds an earlier run's checkpoints" in said
    assert "run it again from its .hydra/config.yaml" in said and "trainer.resume=never" not in said  # (it removes)
    assert {f: f.stat().st_mtime_ns for f in (alone / "checkpoints").iterdir()} == before


def test_a_job_not_started_is_composed_from_the_sweeps_own_config_folders(tmp_path):
    """A sweep launched with a --config-dir of one's own (multirun.yaml's config sources) and stopped before its
    second job: that job's row is composed with the option of one's own (before, from conf/ alone: "?")."""
    own = tmp_path / "own"
    (own / "memory").mkdir(parents=True)
    (own / "memory" / "mine.yaml").write_text("defaults:\n  - none\n  - _self_\naccum_steps: 2\n")
    sweep = tmp_path / "sweep"
    (sweep / "0").mkdir(parents=True)
    (sweep / "0" / "summary.json").write_text(json.dumps(
        {"status": "interrupted", "strategy": "accum", "overrides": ["memory=mine", "seed=1"]}))
    # as Hydra writes it (the parts report.py reads)
    (sweep / "multirun.yaml").write_text(OmegaConf.to_yaml({"hydra": {
        "sweeper": {"_target_": "hydra._internal.core_plugins.basic_sweeper.BasicSweeper", "params": None},
        "overrides": {"task": ["memory=mine", "seed=1,2"]},
        "job": {"config_name": "train"},
        "runtime": {"config_sources": [{"path": "hydra.conf", "schema": "pkg", "provider": "hydra"},
                                       {"path": str(ROOT / "conf"), "schema": "file", "provider": "main"},
                                       {"path": str(own), "schema": "file", "provider": "command-line"},
                                       {"path": "", "schema": "structured", "provider": "schema"}]}}}))
    jobs = load_sweep(sweep)
    assert [(j.started, j.label) for j in jobs] == [(True, "accum seed=1"), (False, "accum seed=2")]
    assert jobs[1].effective_batch == "64 pairs (2 x 32)"


def test_repeated_settings_keep_one_row_per_job(tmp_path):
    """Report rows are per job directory, including jobs whose overrides are identical (repeats of one setting)."""
    sweep = tmp_path / "sweep"
    for job in ("0", "1"):
        d = sweep / job
        d.mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps({"status": "completed", "strategy": "none", "overrides": ["seed=1"]}))
    jobs = load_sweep(sweep)
    assert [j.label for j in jobs] == ["none", "none"] and len(markdown_rows(write_report(sweep)[2])) == 2


def test_jobs_that_differ_in_a_memory_value_have_different_names(tmp_path):
    """memory=amp memory.amp=bf16,fp16: both are labelled amp; their names (report rows, W&B runs) tell them apart."""
    assert run_name("amp", ["memory=amp", "memory.amp=fp16", "model=small"]) == "amp memory.amp=fp16 model=small"
    sweep = tmp_path / "sweep"
    for job, amp in (("0", "bf16"), ("1", "fp16")):
        (sweep / job).mkdir(parents=True)
        (sweep / job / "summary.json").write_text(json.dumps(
            {"status": "completed", "strategy": "amp", "overrides": ["memory=amp", f"memory.amp={amp}"]}))
    assert [j.label for j in load_sweep(sweep)] == ["amp memory.amp=bf16", "amp memory.amp=fp16"]


def test_a_memory_option_file_of_ones_own_is_named_beside_its_label():
    """conf/memory/lowmem.yaml and lowmem16.yaml (bf16 and fp16, each with checkpointing) both resolve to the label
    amp+checkpoint: their names tell them apart; built-in options, which the label names, are not repeated."""
    assert run_name("amp+checkpoint", ["memory=lowmem16", "model=small"]) == "amp+checkpoint memory=lowmem16 model=small"
    assert run_name("amp+accum", ["memory=[amp,accum]", "seed=2"]) == "amp+accum seed=2"
    assert run_name("auto(accum+amp)", ["memory=auto", "memory.budget_gb=12"]) == "auto(accum+amp) memory.budget_gb=12"
    # a resumed attempt keeps the run's W&B name (the W&B run it continues was named without trainer.resume)
    assert run_name("none", ["model=small", "trainer.resume=auto"]) == "none model=small"
    assert run_name("none", ["memory=none", "paths.output_dir=x", "logger=wandb"]) == "none"
    # nor settings that do not describe the run (W&B shows tags apart)
    assert run_name("none", ["fail_on_error=true", "tags=[a,b]", "+meta.note=x", "seed=3"]) == "none seed=3"


def test_the_wandb_summary_holds_the_runs_totals(fast_cfg, tmp_path):
    """The W&B run's summary is summary.json's: the last logged row, committed when the run finished, used to
    overwrite its totals (src_tokens, padding_ratio, model_tflops, ...) with the last window's."""
    summary = train(fast_cfg("logger=wandb", "trainer.max_steps=5", "trainer.eval_every=5"))
    w = read_wandb_run(wandb_file(tmp_path / "run"))["summary"]
    for key in ("src_tokens", "tgt_tokens", "padding_ratio", "model_tflops", "steps", "epochs", "test_bleu"):
        assert w[key] == pytest.approx(summary[key]), key


def test_a_run_out_of_memory_before_its_first_row_has_its_peak_in_the_wandb_summary(fast_cfg, tmp_path):
    """The dashboard compares peaks: a run that ran out of memory at step 3 logged no row (log_every=50), and
    its W&B summary lacked peak_memory_mb, which summary.json has."""
    with pytest.raises(torch.OutOfMemoryError):
        train(fast_cfg("logger=wandb", "fault.kind=oom", "fault.at_step=3", "fault.times=99",
                        "trainer.log_every=50"))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    w = read_wandb_run(wandb_file(tmp_path / "run"))
    assert summary["status"] == "oom" and summary["peak_memory_mb"] > 0
    assert not any("peak_memory_mb" in row for row in w["history"])  # (the back-offs' row has accum_steps)
    assert w["summary"]["peak_memory_mb"] == {"max": summary["peak_memory_mb"]}  # as define_metric's "max" has it


def test_a_job_stopped_by_a_setting_before_its_run_began_is_a_failed_wandb_run(fast_cfg, tmp_path):
    """A sweep's job with a bad setting found before the run begins (model.n_heads=3, before any data is read)
    shows on the dashboard as failed with its reason, as a job failing later does: it had a summary.json only."""
    with pytest.raises(ConfigError, match="model.d_model=128 must be divisible by model.n_heads=3"):
        train(fast_cfg("logger=wandb", "model.n_heads=3"))
    run = tmp_path / "run"
    w = read_wandb_run(wandb_file(run))
    assert w["summary"]["status"] == "failed" and w["exit_code"] == 1
    assert w["summary"]["error"].startswith("model.d_model=128 must be divisible by model.n_heads=3")
    assert w["history"] == []  # nothing logged: no empty row at step 0
    assert json.loads((run / "summary.json").read_text())["status"] == "failed" and (run / "config.yaml").is_file()


def test_a_torchrun_jobs_effective_batch_counts_its_ranks(tmp_path):
    """Under torchrun each rank trains a batch of data.batch_size pairs (or data.max_tokens) per optimizer step."""
    for world, expected in ((1, "64 pairs (4 x 16)"), (2, "2 ranks x 64 pairs (4 x 16)")):
        job = tmp_path / str(world)
        job.mkdir()
        (job / "summary.json").write_text(json.dumps({"status": "completed", "strategy": "accum", "batch_size": 64,
                                                      "final_accum_steps": 4, "world_size": world}))
        assert load_sweep(job)[0].effective_batch == expected


def test_an_uneven_accumulation_shows_its_largest_micro_batch():
    """128 pairs in 3 micro-batches are 43, 43 and 42 pairs (src/data/batching.py's split_batch): the report names
    the largest, which sets the memory; the same for a token budget."""
    from src.report import Job

    assert Job("0", Path("x"), summary={"batch_size": 128, "final_accum_steps": 3}).effective_batch == "128 pairs (3 x 43)"
    assert Job("0", Path("x"), summary={"max_tokens": 1000, "accum_steps": 3}).effective_batch == "1,000 tokens (3 x 334 tokens)"
    backed_off = {"batch_size": 64, "final_accum_steps": 8, "oom_backoffs": [{"step": 1, "accum_steps": 2},
                                                                            {"step": 3, "accum_steps": 8}]}
    assert Job("0", Path("x"), summary=backed_off).effective_batch == "64 pairs (8 x 8 from step 3)"


def test_a_damaged_line_inside_metrics_jsonl_is_named_and_a_cut_last_line_is_not(tmp_path):
    from src.errors import DataError
    from src.report import _read_jsonl

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 5.0}\n{"step": 2, "lo\n{"step": 3, "loss": 4.0}\n')
    with pytest.raises(DataError, match=rf"^{path}, line 2: not valid JSON$"):
        _read_jsonl(path)
    path.write_text('{"step": 1, "loss": 5.0}\n{"step": 3, "loss": 4.0}\n{"step": 4, "lo')
    assert [r["step"] for r in _read_jsonl(path)] == [1, 3]


def markdown_rows(table: str) -> list[str]:
    return [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| job")]



def test_a_non_finite_figure_is_written_as_null(tmp_path):
    """metrics.jsonl is JSON, which has no NaN or infinity (an fp16 overflow's grad_norm, the ppl of a loss above
    88): both are written as null, which any JSON reader reads, not as Python's NaN or Infinity, which most refuse."""
    from src.loggers import RunLogger

    logger = RunLogger(tmp_path, {"wandb": {"mode": "disabled"}}, {"a": 1}, name="none")
    logger.log({"loss": 1.5, "grad_norm": float("inf"), "ppl": float("nan"), "lr": -float("inf")}, step=1)
    logger.finish({"status": "completed"})

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    rows = [json.loads(line, parse_constant=refuse) for line in logger.path.read_text().splitlines()]
    assert rows == [{"step": 1, "loss": 1.5, "grad_norm": None, "ppl": None, "lr": None}]


def test_rewinding_the_log_keeps_the_rows_up_to_the_resumed_step(tmp_path):
    """A run resumed at step 2 trains steps 3 and 4 again: their rows go and step 2's stays; a row the crash cut
    short is dropped."""
    from src.loggers import RunLogger

    logger = RunLogger(tmp_path, {"wandb": {"mode": "disabled"}}, {"a": 1}, name="none")
    for step in (1, 2, 3, 4):
        logger.log({"loss": float(step)}, step=step)
    with logger.path.open("a") as f:
        f.write('{"step": 5, "lo')
    logger.rewind(2)
    logger.log({"loss": 3.5}, step=3)
    logger.finish({"status": "completed"})
    assert [(r["step"], r["loss"]) for r in read_jsonl(logger.path)] == [(1, 1.0), (2, 2.0), (3, 3.5)]


def test_wandb_modes(tmp_path, monkeypatch):
    """disabled logs nothing and finishes; online without a key is one clear line, before any training."""
    from src.errors import ConfigError
    from src.loggers import RunLogger

    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc: not logged in
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "home" / ".config"))
    logger = RunLogger(tmp_path / "disabled", {"wandb": {"mode": "disabled", "samples": 2}}, {"a": 1}, name="none")
    logger.log({"loss": 1.0}, step=1)
    logger.log_samples(1, ["s"], ["r"], ["h"])
    logger.finish({"status": "completed"})
    assert not (tmp_path / "disabled" / "wandb").exists()
    assert read_jsonl(tmp_path / "disabled" / "metrics.jsonl") == [{"step": 1, "loss": 1.0}]
    from src import loggers

    with monkeypatch.context() as m:
        m.setattr(loggers, "unreachable", lambda url: None)  # a server that answers: W&B's own check of the key
        with pytest.raises(ConfigError, match=r"^logger.wandb.mode=online: No API key configured"):
            RunLogger(tmp_path / "online", {"wandb": {"mode": "online"}}, {"a": 1}, name="none")
    with pytest.raises(ConfigError, match=r"^logger.wandb.mode=ofline: expected one of online, offline, disabled, "
                                          r"shared, dryrun, run; did you mean offline\?$"):
        RunLogger(tmp_path / "typo", {"wandb": {"mode": "ofline"}}, {"a": 1}, name="none")
    monkeypatch.setenv("WANDB_MODE", "disabeld")  # the variable wins over the setting, and is checked as well
    with pytest.raises(ConfigError, match=r"^WANDB_MODE=disabeld: expected one of .*; did you mean disabled\?$"):
        RunLogger(tmp_path / "typo", {"wandb": {"mode": "offline"}}, {"a": 1}, name="none")
    monkeypatch.delenv("WANDB_MODE")
    # conf/logger/csv.yaml setting logger.csv, with no logger behind it: refused by name (it was ignored), with
    # settings or without (`csv:`, null), before W&B starts
    for csv in ({"path": "metrics.csv"}, None, {}):
        with pytest.raises(ConfigError, match=r"^logger.csv: no logger of that name \(src/loggers.py's BACKENDS has wandb\)$"):
            RunLogger(tmp_path / "csv", {"wandb": {"mode": "disabled"}, "csv": csv}, {"a": 1}, name="none")
    assert not (tmp_path / "csv").exists()
    RunLogger(tmp_path / "off", {"wandb": False}, {"a": 1}, name="none").finish({"status": "completed"})
    assert not (tmp_path / "off" / "wandb").exists() and (tmp_path / "off" / "metrics.jsonl").exists()


def test_online_a_server_that_does_not_answer_is_waited_for_once_a_process(tmp_path, monkeypatch, shared_cache):
    """W&B's server out of reach (no network): wandb.init raises CommError after init_timeout. It was a traceback,
    after waiting twice (the failed run started its logger again to record the failure), and again in each job of
    a sweep: now one line, once, and the next job of the process fails at once. wandb.init is replaced."""
    import wandb

    from src import loggers

    monkeypatch.setattr(loggers, "_server_unanswered", None)
    monkeypatch.setattr(loggers, "unreachable", lambda url: None)  # reached, but no answer to wandb.init
    calls = []

    def init(**kwargs):
        calls.append(kwargs["settings"].init_timeout)
        raise wandb.errors.CommError("Timed out initializing run: POST https://api.wandb.ai/graphql giving up\nmore")

    monkeypatch.setattr(wandb, "init", init)
    monkeypatch.delenv("WANDB_MODE")
    said = ("logger.wandb.mode=online: W&B's server did not answer within logger.wandb.init_timeout=7 s (Timed out "
            "initializing run: POST https://api.wandb.ai/graphql giving up); log with logger.wandb.mode=offline and "
            "upload later with `wandb sync <run dir>/wandb/offline-run-*`")
    for job, after in ((0, ""), (1, " (as for an earlier job of this process)")):
        cfg = compose_config(*FAST, "logger=wandb", "logger.wandb.mode=online", "logger.wandb.init_timeout=7",
                             run_dir=tmp_path / str(job), cache_dir=shared_cache)
        with pytest.raises(ConfigError) as e:
            train(cfg)
        assert str(e.value) == said + after
        summary = json.loads((tmp_path / str(job) / "summary.json").read_text())
        assert summary["status"] == "failed" and summary["error"] == said + after
    assert calls == [7]  # waited for once: not again to record the failure, nor in the next job


def test_online_a_server_that_cannot_be_reached_is_said_at_once(tmp_path, monkeypatch):
    """Nothing at W&B's address (no network, a wrong WANDB_BASE_URL): wandb.init waited init_timeout (90 s; 104 s
    in all) before it said so. One request says it at once, without wandb.init, and the next job of the process
    fails at once too."""
    import wandb

    from src import loggers
    from src.errors import ConfigError
    from src.loggers import RunLogger

    monkeypatch.setattr(loggers, "_server_unanswered", None)
    monkeypatch.setattr(wandb, "init", lambda **kwargs: pytest.fail("wandb.init called"))
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # the discard port: no one listens
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    monkeypatch.delenv("WANDB_MODE")
    said = ("logger.wandb.mode=online: W&B's server at http://127.0.0.1:9 cannot be reached ([Errno 111] Connection "
            "refused); log with logger.wandb.mode=offline and upload later with `wandb sync <run dir>/wandb/"
            "offline-run-*`")
    for job, after in ((0, ""), (1, " (as for an earlier job of this process)")):
        started = time.perf_counter()
        with pytest.raises(ConfigError) as e:
            RunLogger(tmp_path / str(job), {"wandb": {"mode": "online"}}, {}, name="none")
        assert str(e.value) == said + after and time.perf_counter() - started < 20


def test_a_server_is_unreachable_only_where_nothing_answers():
    """network.unreachable: a refused connection and a host without an address are unreachable; a server that
    answers, even with an error, is not, nor one that takes the connection and is slow to answer."""
    import http.server
    import socket
    import threading

    from src.network import unreachable

    assert unreachable("http://127.0.0.1:9") == "[Errno 111] Connection refused"
    assert unreachable("http://no-such-host.invalid") is not None  # .invalid never resolves
    with socket.create_server(("127.0.0.1", 0)) as slow:  # connections taken (by the kernel), never answered
        assert unreachable(f"http://127.0.0.1:{slow.getsockname()[1]}", timeout=1) is None
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)  # 501 to HEAD
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert unreachable(f"http://127.0.0.1:{server.server_port}") is None
    finally:
        server.shutdown()


def test_online_a_resumed_run_asks_wandb_to_continue_its_run(tmp_path, monkeypatch):
    """Online, a run resumed in its own directory passes the id it stored with resume="allow" (how W&B continues
    a run); a new run passes neither. wandb.init is replaced: this machine cannot reach W&B."""
    import types

    import wandb

    from src import loggers
    from src.loggers import WANDB_ID_FILE, RunLogger

    calls = []

    def init(**kwargs):
        calls.append(kwargs)
        run = types.SimpleNamespace(id=kwargs["id"] or f"run{len(calls)}", summary={}, log=lambda *a, **k: None,
                                    define_metric=lambda *a, **k: None, finish=lambda **k: None)
        return run

    monkeypatch.setattr(wandb, "init", init)
    monkeypatch.setattr(loggers, "unreachable", lambda url: None)
    monkeypatch.setenv("WANDB_MODE", "online")
    for resuming in (False, True):
        RunLogger(tmp_path, {"wandb": {"mode": "online"}}, {}, name="none", resuming=resuming).finish({"status": "completed"})
    assert [(c["id"], c["resume"]) for c in calls] == [(None, None), ("run1", "allow")]
    assert (tmp_path / WANDB_ID_FILE).read_text().strip() == "run1"
    # tags: a list as given; one word (logger.wandb.tags=memory, typed as a string) is one tag, not its letters
    for tags, expected in ((["a", "b"], ["a", "b"]), ("memory", ["memory"]), (None, [])):
        RunLogger(tmp_path / "tags", {"wandb": {"mode": "online", "tags": tags}}, {}, name="none").finish({"status": "completed"})
        assert calls[-1]["tags"] == expected



def test_a_sweep_launched_again_into_its_directory_reports_its_own_jobs(tmp_path, caplog):
    """hydra.sweep.dir given again: the report and the sweep's exit status are the latest launch's. Its jobs are
    those written since Hydra wrote multirun.yaml; an earlier launch's job (2: the sweep had three jobs, now two)
    is left out, and a job of this launch killed before its summary (1) is not the earlier summary's "completed".
    A job's file dated up to a second before multirun.yaml is this launch's: file systems keep coarse times."""
    import os

    from src.callbacks import SweepStatus, outcome

    sweep = tmp_path / "sweep"
    for job in ("0", "1", "2"):
        (sweep / job / ".hydra").mkdir(parents=True)
        (sweep / job / ".hydra" / "overrides.yaml").write_text(f"- memory.accum_steps={int(job) + 1}\n")
        (sweep / job / "summary.json").write_text(json.dumps({"status": "completed", "strategy": "accum"}))
        for f in (".hydra/overrides.yaml", "summary.json"):
            os.utime(sweep / job / f, (1e9, 1e9))  # the earlier launch
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    os.utime(sweep / "multirun.yaml", (1.5e9, 1.5e9))
    for job, written, when in (("0", (".hydra/overrides.yaml", "summary.json"), 1.5e9 + 60),
                               ("1", (".hydra/overrides.yaml",), 1.5e9 - 0.5)):  # (a file system's coarse times)
        for f in written:
            os.utime(sweep / job / f, (when, when))
    assert len(load_sweep(sweep)) == 3  # a report run later (on a copy, say) shows every job there
    jobs = load_sweep(sweep, latest_launch=True)
    assert [(j.name, j.status) for j in jobs] == [("0", "completed"), ("1", None)]
    assert "1 job directory of an earlier launch of the sweep left out (2)" in caplog.text
    SweepStatus().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}}))
    assert outcome.failed == [f"job 1 ({sweep / '1'}): no summary.json of this launch"]
    outcome.failed = None
    os.utime(sweep / "multirun.yaml")  # launched again now: none of its jobs has started
    with pytest.raises(DataError, match="no job of the sweep's latest launch wrote anything"):
        load_sweep(sweep, latest_launch=True)
