"""Runs that survive: a run killed between checkpoints resumes exactly, SIGTERM leaves a resumable checkpoint, a
truncated checkpoint is passed over, and NaN losses are skipped or stop the run."""

import json
import logging
import math
import re
import signal
from pathlib import Path

import pytest
import torch

import src.evaluate
import src.run
from src.checkpoint import load_checkpoint
from src.errors import ConfigError, NumericalError
from src.run import train
from src.state import drop_later_checkpoints, same_checkpoint_on_every_rank

from .conftest import FAST, compose_config
from .helpers import read_jsonl, read_wandb_run, run_cli

# 24 steps of 16 pairs over 300 pairs (19 batches an epoch): the run crosses into a second epoch
STEPS = ["trainer.max_steps=24", "trainer.log_every=1", "trainer.eval_every=24", "trainer.save_every=5"]


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r}


def ledger(run: Path) -> dict[int, dict]:
    return {r["step"]: {k: v for k, v in r.items() if k.startswith("mem_") or k == "step_peak_mb"}
            for r in read_jsonl(run / "metrics.jsonl") if "step_peak_mb" in r}


def final_state(run: Path) -> dict:
    return load_checkpoint(run / "checkpoints" / "step_00000024.pt")["model"]


@pytest.mark.slow
def test_a_killed_run_resumes_as_if_nothing_happened(tmp_path, shared_cache):
    common = [*FAST, *STEPS, f"paths.cache_dir={shared_cache}"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    train(compose_config(*common, run_dir=straight))  # the reference, in this process; the others as users run them

    proc = run_cli("train.py", *common, "fault.kind=kill", "fault.at_step=13", f"hydra.run.dir={killed}")
    assert proc.returncode == -signal.SIGKILL  # no handler runs: the last checkpoint is step 10
    assert max(losses(killed)) == 12 and not (killed / "summary.json").exists()
    proc = run_cli("train.py", *common, "trainer.resume=auto", f"hydra.run.dir={killed}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((killed / "summary.json").read_text())
    assert summary["resumed_from"]["step"] == 10 and summary["steps"] == 24

    a, b = losses(straight), losses(killed)
    assert sorted(a) == sorted(b) == list(range(1, 25))
    # steps 11-12, logged by the killed attempt, were trained again: their rows are the second attempt's alone
    assert [r["step"] for r in read_jsonl(killed / "metrics.jsonl")] == [
        r["step"] for r in read_jsonl(straight / "metrics.jsonl")]
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-6, abs=1e-6), step
    sa, sb = final_state(straight), final_state(killed)
    for name in sa:
        torch.testing.assert_close(sb[name], sa[name], rtol=1e-6, atol=1e-6, msg=name)
    assert summary["tgt_tokens"] == json.loads((straight / "summary.json").read_text())["tgt_tokens"]
    # and so does the memory ledger: the optimizer state loaded from the checkpoint is counted as the state
    # created in training was, in every step's peak and split
    la, lb = ledger(straight), ledger(killed)
    assert sorted(la) == sorted(lb) == list(range(1, 25))
    for step in range(11, 25):
        assert lb[step] == la[step], step
    assert min(lb[step]["mem_optimizer_mb"] for step in range(11, 25)) > 0
    # the run's peaks are those of both its parts (the checkpoint carries the first part's)
    first = json.loads((straight / "summary.json").read_text())
    for key in ("peak_memory_mb", "peak_memory_split_mb", "memory_delta_mb"):
        assert summary[key] == first[key], key


@pytest.mark.slow
def test_a_resumed_runs_memory_peaks_are_the_uninterrupted_runs_to_the_byte(tmp_path, shared_cache):
    """Stopped by SIGTERM after step 8 and resumed, the run's peak falls on step 9, the first after the restart:
    its bytes, as the last checkpoint carries them, are those of the run never stopped. The step before's
    statistics (three device scalars) were still alive while the next step ran, except in a restarted process's
    first step, which counted 12 bytes less."""
    from src.faults import Interrupted

    common = [*FAST, "trainer.max_steps=10", "trainer.eval_every=4", "trainer.log_every=1", "trainer.save_every=2"]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    train(compose_config(*common, run_dir=straight, cache_dir=shared_cache))
    with pytest.raises(Interrupted):
        train(compose_config(*common, "fault.kind=sigterm", "fault.at_step=8", run_dir=stopped, cache_dir=shared_cache))
    train(compose_config(*common, "trainer.resume=auto", run_dir=stopped, cache_dir=shared_cache))
    memory = [load_checkpoint(run / "checkpoints" / "step_00000010.pt")["progress"]["memory"] for run in (straight,
                                                                                                         stopped)]
    assert memory[1]["run_peak"] == memory[0]["run_peak"] and memory[1] == memory[0]


@pytest.mark.slow
def test_a_stopped_and_resumed_run_keeps_and_averages_the_checkpoints_of_the_run_never_stopped(tmp_path, shared_cache):
    """A stop writes a checkpoint at whatever step the signal came (9, between the checkpoints every 2 steps): it
    counted as one of the run's step checkpoints, so pruning removed step 6 for it and average_last=3 tested steps
    8, 9 and 10, not the uninterrupted run's 6, 8 and 10. It is removed once the next scheduled one is written."""
    from src.faults import Interrupted

    common = [*FAST, "trainer.max_steps=10", "trainer.eval_every=5", "trainer.save_every=2", "trainer.keep_last=3",
              "trainer.average_last=3"]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    first = train(compose_config(*common, run_dir=straight, cache_dir=shared_cache))
    with pytest.raises(Interrupted):
        train(compose_config(*common, "fault.kind=sigterm", "fault.at_step=9", run_dir=stopped, cache_dir=shared_cache))
    assert sorted(p.name for p in (stopped / "checkpoints").glob("step_*.pt")) == [
        "step_00000004.pt", "step_00000006.pt", "step_00000008.pt", "step_00000009.pt"]  # step 4 not pruned for 9
    resumed = train(compose_config(*common, "trainer.resume=auto", run_dir=stopped, cache_dir=shared_cache))
    names = [sorted(p.name for p in (run / "checkpoints").glob("step_*.pt")) for run in (straight, stopped)]
    assert names[0] == names[1] == ["step_00000006.pt", "step_00000008.pt", "step_00000010.pt"]
    assert resumed["test_checkpoints"] == first["test_checkpoints"] == names[0]
    assert (stopped / "test.hyp.txt").read_text() == (straight / "test.hyp.txt").read_text()


@pytest.mark.slow
def test_a_stopped_and_resumed_run_logs_the_uninterrupted_runs_rows(tmp_path, shared_cache):
    """A stop between log lines (after step 7 of windows of 5 steps) logged the open window as a row of its own
    (step 7), and the resumed run's next row held steps 8-10 alone: another loss curve. The stop's checkpoint
    carries the open window; the resumed run logs it whole, and the stopped attempt's summary counts its tokens."""
    from src.faults import Interrupted

    common = [*FAST, "trainer.max_steps=15", "trainer.log_every=5", "trainer.eval_every=15", "trainer.save_every=5"]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    first = train(compose_config(*common, run_dir=straight, cache_dir=shared_cache))
    with pytest.raises(Interrupted):
        train(compose_config(*common, "fault.kind=sigterm", "fault.at_step=7", run_dir=stopped, cache_dir=shared_cache))
    interrupted = json.loads((stopped / "summary.json").read_text())
    assert interrupted["status"] == "interrupted" and interrupted["steps"] == 7
    rows = [r for r in read_jsonl(stopped / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [5]  # no row for the window the stop cut short
    resumed = train(compose_config(*common, "trainer.resume=auto", run_dir=stopped, cache_dir=shared_cache))
    rows = [[r for r in read_jsonl(run / "metrics.jsonl") if "loss" in r] for run in (straight, stopped)]
    assert [r["step"] for r in rows[1]] == [r["step"] for r in rows[0]] == [5, 10, 15]
    for key in ("loss", "nll", "grad_norm", "tgt_tokens", "pairs", "peak_memory_mb"):
        assert [r[key] for r in rows[1]] == pytest.approx([r[key] for r in rows[0]], rel=1e-6, abs=1e-6), key
    assert (resumed["src_tokens"], resumed["tgt_tokens"]) == (first["src_tokens"], first["tgt_tokens"])
    assert 0 < interrupted["tgt_tokens"] < first["tgt_tokens"]


def test_pruning_counts_the_schedule_and_the_last_step(tmp_path):
    from src.state import prune

    def left(steps, every, final=None):
        for f in tmp_path.glob("*.pt"):
            f.unlink()
        for step in steps:
            (tmp_path / f"step_{step:08d}.pt").write_bytes(b"")
        prune(tmp_path, 3, every, final)
        return sorted(int(f.stem[5:]) for f in tmp_path.glob("*.pt"))

    assert left([2, 4, 6, 7], 2) == [2, 4, 6, 7]  # a stop's at 7: kept, uncounted, until a scheduled one is newer
    assert left([2, 4, 6, 7, 8], 2) == [4, 6, 8]
    assert left([3, 6, 9, 10], 3, final=10) == [6, 9, 10]  # the last step, off the schedule, is the run's
    assert left([3, 6, 9, 10], None) == [6, 9, 10]  # no schedule: the newest


def test_a_failed_attempts_summary_gives_way_to_the_next_attempts(fast_cfg):
    """Only an earlier run worth keeping (checkpoints, a completed summary) is left alone by an attempt refused
    before it starts; an earlier failed attempt's summary is replaced by the new one's error."""
    for override in ("memory.accum_steps=0", "trainer.log_every=0"):
        cfg = fast_cfg(override)
        with pytest.raises(ConfigError):
            train(cfg)
        summary = json.loads((Path(cfg.paths.output_dir) / "summary.json").read_text())
        assert summary["status"] == "failed" and summary["error"].startswith(override.split("=")[0]), summary


def test_a_finished_run_resumed_keeps_its_figures(fast_cfg):
    """resume=auto in a run directory whose run has ended trains no step; its summary, written again, keeps the
    run's training figures (they come from the checkpoint) and tests the same weights."""
    first = train(fast_cfg("trainer.max_steps=4", "trainer.eval_every=4"))
    again = train(fast_cfg("trainer.max_steps=4", "trainer.eval_every=4", "trainer.resume=auto"))
    assert again["resumed_from"]["step"] == 4
    for key in ("steps", "tgt_tokens", "tokens_per_s", "peak_memory_mb", "peak_memory_split_mb", "memory_delta_mb",
                "valid_bleu", "test_bleu"):
        assert again[key] == first[key], key


@pytest.mark.slow
def test_a_run_resumed_with_accumulation_and_another_learning_rate_trains_with_them(fast_cfg, tmp_path, shared_cache,
                                                                                   caplog):
    """The student out of memory resumes with memory=accum and a lower peak learning rate: the steps after the
    checkpoint run in 2 micro-batches at the new rate, as a run started with those settings does at those steps
    (the checkpoint's accum_steps, Adam betas and peak rate were put back, while config.yaml said otherwise)."""
    train(fast_cfg("trainer.max_steps=4", "trainer.log_every=1"))
    new = ["trainer.max_steps=6", "trainer.log_every=1", "memory=accum", "memory.accum_steps=2", "optim.lr=1e-4",
           "optim.betas=[0.8,0.99]"]
    with caplog.at_level(logging.INFO):
        resumed = train(fast_cfg(*new, "trainer.resume=auto"))
    fresh = train(compose_config(*FAST, *new, run_dir=tmp_path / "fresh", cache_dir=shared_cache))
    assert resumed["resumed_from"]["step"] == 4 and resumed["final_accum_steps"] == fresh["final_accum_steps"] == 2
    lrs = [{r["step"]: r["lr"] for r in read_jsonl(d / "metrics.jsonl") if "lr" in r} for d in (tmp_path / "run",
                                                                                                 tmp_path / "fresh")]
    assert [lrs[0][s] for s in (5, 6)] == [lrs[1][s] for s in (5, 6)]
    assert "other optimizer settings than the checkpoint's (betas, lr)" in caplog.text
    assert "accum_steps 2 from here (the checkpoint's 1)" in caplog.text
    assert "resumed with other memory, optim settings than the run that wrote it" in caplog.text
    # config.yaml is the last attempt's: the summary keeps what each resume changed, and where
    again = train(fast_cfg(*new[1:], "trainer.max_steps=8", "optim.warmup_steps=2", "trainer.resume=auto"))
    (first, second) = again["resumes"]
    assert first["step"] == 4 and second == {"step": 6, "changed": {"trainer.max_steps": [6, 8],
                                                                    "optim.warmup_steps": [400, 2]}}
    assert first["changed"]["optim.lr"] == [5e-4, 1e-4] and first["changed"]["optim.betas"] == [[0.9, 0.98], [0.8, 0.99]]
    assert first["changed"]["memory.accum_steps"] == [1, 2] and first["changed"]["trainer.max_steps"] == [4, 6]
    assert not any(key.startswith(("paths.", "trainer.resume")) for key in first["changed"])


@pytest.mark.slow
def test_a_run_resumed_with_another_warmup_trains_at_its_rate_from_the_first_step(fast_cfg, tmp_path, shared_cache,
                                                                                 caplog):
    """The peak learning rate unchanged, only the schedule's warmup: the first resumed step already runs at the
    new schedule's rate (it ran at the checkpoint's, the new schedule applying from the step after)."""
    train(fast_cfg("trainer.max_steps=4", "trainer.log_every=1"))
    new = ["trainer.max_steps=6", "trainer.log_every=1", "optim.warmup_steps=2"]
    with caplog.at_level(logging.INFO):
        train(fast_cfg(*new, "trainer.resume=auto"))
    fresh = train(compose_config(*FAST, *new, run_dir=tmp_path / "fresh", cache_dir=shared_cache))
    assert fresh["status"] == "completed"
    lrs = [{r["step"]: r["lr"] for r in read_jsonl(d / "metrics.jsonl") if "lr" in r} for d in (tmp_path / "run",
                                                                                                 tmp_path / "fresh")]
    assert [lrs[0][s] for s in (5, 6)] == [lrs[1][s] for s in (5, 6)] == pytest.approx([5e-4 * (2 / 5) ** 0.5,
                                                                                         5e-4 * (2 / 6) ** 0.5])
    assert "other optimizer settings than the checkpoint's (warmup_steps)" in caplog.text


@pytest.mark.slow
def test_sigterm_writes_a_checkpoint_and_an_interrupted_summary(tmp_path, shared_cache):
    run = tmp_path / "run"
    proc = run_cli("train.py", *FAST, *STEPS, "fault.kind=sigterm", "fault.at_step=7", f"hydra.run.dir={run}",
                   f"paths.cache_dir={shared_cache}")
    assert proc.returncode == 128 + signal.SIGTERM
    said = f"SIGTERM at step 7: checkpoint written; continue with trainer.resume=auto and hydra.run.dir={run}"
    assert said in proc.stdout + proc.stderr  # the default run directory is named by the time it started
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["error"] == said  # why too, for the report and W&B
    ckpt = load_checkpoint(run / "checkpoints" / "step_00000007.pt")
    # what it had reached, as the checkpoint holds it
    assert summary["steps"] == 7 and summary["tgt_tokens"] == ckpt["progress"]["totals"]["total_tgt_tokens"] > 0
    assert summary["peak_memory_mb"] == pytest.approx(ckpt["progress"]["memory"]["run_peak"] / 2**20, abs=0.05)
    assert ckpt["progress"]["step"] == 7 and ckpt["progress"]["batches_done"] == 7
    assert {"model", "optimizer", "scheduler", "scaler", "rng", "config"} <= ckpt.keys()


@pytest.mark.slow
def test_resume_auto_passes_over_checkpoints_that_load_but_cannot_be_resumed(fast_cfg, caplog):
    """Bytes changed on disk that still load: NaN weights (resumed, every step was skipped as non-finite, then
    decoding raised), and a checkpoint without its step (resumed "at step 0", the run removed the later checkpoints,
    the one it resumed from among them) or without its random state (a KeyError traceback)."""
    steps = ["trainer.max_steps=8", "trainer.save_every=2", "trainer.eval_every=8", "trainer.keep_last=4"]
    cfg = fast_cfg(*steps)
    train(cfg)
    ckpts = Path(cfg.paths.output_dir) / "checkpoints"
    for step, damage in ((8, "rng"), (6, "step"), (4, "nan")):
        path = ckpts / f"step_{step:08d}.pt"
        state = load_checkpoint(path)
        if damage == "rng":
            del state["rng"]
        elif damage == "step":
            del state["progress"]["step"]
        else:
            next(iter(state["model"].values())).fill_(float("nan"))
        torch.save(state, path)
    (ckpts / "best.pt").unlink()
    with caplog.at_level(logging.WARNING):
        summary = train(fast_cfg(*steps, "trainer.resume=auto"))
    assert summary["resumed_from"] == {"path": str(ckpts / "step_00000002.pt"), "step": 2}
    assert "step_00000008.pt is unreadable (not a whole training checkpoint)" in caplog.text
    assert "step_00000006.pt is unreadable (not a whole training checkpoint)" in caplog.text
    assert "step_00000004.pt is unreadable (src_embed.tokens.weight holds NaN or infinite values)" in caplog.text
    assert summary["status"] == "completed" and summary["steps"] == 8 and math.isfinite(summary["test_bleu"])


@pytest.mark.slow
def test_a_resumed_attempt_removes_the_earlier_attempts_summary_when_it_starts(tmp_path, shared_cache):
    """A resumed attempt killed outright (SIGKILL: no summary of its own) left the earlier attempt's summary.json
    ("completed" at step 6) and test.hyp.txt beside checkpoints and metrics of later steps."""
    common = [*FAST, "trainer.save_every=2", f"paths.cache_dir={shared_cache}"]
    run = tmp_path / "run"
    train(compose_config(*common, "trainer.max_steps=6", "trainer.eval_every=6", run_dir=run))
    assert (run / "summary.json").exists() and (run / "test.hyp.txt").exists()
    proc = run_cli("train.py", *common, "trainer.max_steps=10", "trainer.eval_every=10", "trainer.resume=auto",
                   "fault.kind=kill", "fault.at_step=8", f"hydra.run.dir={run}")
    assert proc.returncode == -signal.SIGKILL
    assert not (run / "summary.json").exists() and not (run / "test.hyp.txt").exists()


def test_resume_auto_passes_over_a_truncated_checkpoint(fast_cfg, tmp_path, caplog):
    cfg = fast_cfg("trainer.max_steps=6", "trainer.save_every=2", "trainer.eval_every=6")
    train(cfg)
    ckpts = Path(cfg.paths.output_dir) / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step_*.pt")) == ["step_00000002.pt", "step_00000004.pt",
                                                                "step_00000006.pt"]
    newest = ckpts / "step_00000006.pt"
    for path in (newest, ckpts / "best.pt"):  # a full disk: both files of step 6 cut short (an intact best.pt of
        path.write_bytes(path.read_bytes()[:1000])  # step 6 would be resumed from: the newest state there is)
    partial = ckpts / ".step_00000008.pt.x1y2z3.tmp"  # atomic_path's temporary file, the run killed while writing
    partial.write_bytes(b"\0" * 1000)
    run_dir = ckpts.parent  # and those of the summary and of the tokenizer's folder (atomic_dir), killed likewise
    partial_files = [run_dir / ".summary.json.a1b2.tmp", run_dir / "tokenizer" / ".hf.c3d4.tmp" / "tokenizer.json",
                     run_dir / "tokenizer" / ".hf.e5f6.old" / "hf" / "tokenizer.json"]  # (between its two renames)
    for path in [*partial_files, run_dir / ".another.tool.tmp"]:  # not the run's: left
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("{")
    with caplog.at_level(logging.WARNING):
        summary = train(fast_cfg("trainer.max_steps=8", "trainer.save_every=2", "trainer.eval_every=8",
                                 "trainer.resume=auto"))
    assert summary["resumed_from"] == {"path": str(ckpts / "step_00000004.pt"), "step": 4}
    assert any("step_00000006.pt is unreadable" in r.message and "trying the previous" in r.message
               for r in caplog.records)
    assert summary["steps"] == 8
    assert not partial.exists() and "removed 1 checkpoint(s) left half-written" in caplog.text
    assert not any(path.exists() for path in partial_files)
    assert sorted(p.name for p in (run_dir / "tokenizer").iterdir()) == ["codecs.json"]  # the folders too, emptied
    assert (run_dir / ".another.tool.tmp").exists()
    assert "removed 1 file(s) left half-written in " + str(run_dir) + " " in caplog.text


def test_resume_auto_continues_from_best_pt_where_it_is_the_newest_state(fast_cfg, tmp_path, shared_cache):
    """trainer.save_every above eval_every: a run killed after a validation and before its next step checkpoint
    holds only best.pt, a whole training state, which resume=auto continues from (it started over from step 0,
    removing best.pt); the steps after it are those of the run that never stopped."""
    settings = ["trainer.eval_every=2", "trainer.save_every=10", "trainer.log_every=1"]
    straight = compose_config(*FAST, *settings, "trainer.max_steps=5", run_dir=tmp_path / "straight",
                              cache_dir=shared_cache)
    train(straight)
    cfg = fast_cfg(*settings, "trainer.max_steps=5")
    train(cfg)
    run = Path(cfg.paths.output_dir)
    for path in [*run.glob("checkpoints/step_*.pt"), run / "summary.json"]:  # as if killed before step 5
        path.unlink()
    best = load_checkpoint(run / "checkpoints" / "best.pt")["progress"]["step"]  # step 2 or 4: the better BLEU
    resumed = train(fast_cfg(*settings, "trainer.max_steps=5", "trainer.resume=auto"))
    assert resumed["resumed_from"] == {"path": str(run / "checkpoints" / "best.pt"), "step": best}
    losses = [{r["step"]: r["loss"] for r in read_jsonl(d / "metrics.jsonl") if "loss" in r}
              for d in (run, tmp_path / "straight")]
    assert losses[0] == losses[1] and len(losses[0]) == 5


def same_state(a, b) -> bool:
    """Two checkpoints' contents are equal: every tensor, number and string."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(same_state, a, b))
    return a == b or (a != a and b != b)  # (NaN)


def test_a_step_checkpoint_is_written_once(fast_cfg, monkeypatch, tmp_path, shared_cache):
    """A run whose last step is a save step ends without writing that checkpoint again; and a step checkpoint at
    the step its best.pt was written at is that file under a second name (a hard link: one file on disk, one
    write), whose state is the one a write of its own holds, where the file system has no hard links."""
    written = []

    def save_checkpoint(path, **state):
        written.append(path.name)
        real(path, **state)

    real = src.run.save_checkpoint
    monkeypatch.setattr(src.run, "save_checkpoint", save_checkpoint)
    settings = ["trainer.max_steps=4", "trainer.save_every=2", "trainer.eval_every=4"]
    train(fast_cfg(*settings))
    assert written == ["step_00000002.pt", "best.pt"]
    linked = tmp_path / "run" / "checkpoints"
    assert (linked / "step_00000004.pt").samefile(linked / "best.pt")

    monkeypatch.setattr(src.run, "link_atomically", lambda existing, path: False)
    written.clear()
    train(compose_config(*FAST, *settings, run_dir=tmp_path / "unlinked", cache_dir=shared_cache))
    assert written == ["step_00000002.pt", "best.pt", "step_00000004.pt"]
    unlinked = tmp_path / "unlinked" / "checkpoints"
    best, step = (load_checkpoint(unlinked / name) for name in ("best.pt", "step_00000004.pt"))
    assert same_state(best, step)


def test_between_validations_of_equal_bleu_the_lower_nll_is_the_best(fast_cfg, monkeypatch, tmp_path):
    """A short run's early validations all score BLEU 0 (an overfit batch's all 100): the best of them is the one
    of the lowest validation NLL (it was the first), not of the label-smoothed loss, and the test set is
    translated by it."""
    translate, loss = src.evaluate.Evaluator.translate, src.evaluate.Evaluator.loss
    made_up = iter([(1.0, 2.0), (2.0, 1.0), (0.5, 1.5)])  # (loss, NLL) of the validations at steps 2, 4 and 6

    def equal_valid_bleu(self, model, split):
        scores, hyps = translate(self, model, split)
        return ({**scores, "bleu": 0.0} if split == "valid" else scores), hyps

    def made_up_loss(self, model):
        losses = loss(self, model)
        losses["loss"], losses["nll"] = next(made_up)
        return losses

    monkeypatch.setattr(src.evaluate.Evaluator, "translate", equal_valid_bleu)
    monkeypatch.setattr(src.evaluate.Evaluator, "loss", made_up_loss)
    summary = train(fast_cfg("trainer.max_steps=6", "trainer.eval_every=2"))
    assert [(row["step"], row["valid_nll"]) for row in read_jsonl(tmp_path / "run" / "metrics.jsonl")
            if "valid_nll" in row] == [(2, 2.0), (4, 1.0), (6, 1.5)]
    assert (summary["best_step"], summary["valid_bleu"], summary["valid_nll"]) == (4, 0.0, 1.0)
    assert load_checkpoint(tmp_path / "run" / "checkpoints" / "best.pt")["progress"]["step"] == 4


def test_only_the_last_checkpoints_are_kept_and_ckpt_path_resumes_elsewhere(fast_cfg, tmp_path, shared_cache):
    cfg = fast_cfg("trainer.max_steps=6", "trainer.save_every=1", "trainer.keep_last=2", "trainer.eval_every=6")
    train(cfg)
    ckpts = Path(cfg.paths.output_dir) / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("*.pt")) == ["best.pt", "step_00000005.pt", "step_00000006.pt"]
    other = compose_config(*FAST, "trainer.max_steps=7", "trainer.eval_every=7", f"ckpt_path={ckpts / 'step_00000005.pt'}",
                           run_dir=tmp_path / "other", cache_dir=shared_cache)
    summary = train(other)
    assert summary["resumed_from"]["step"] == 5 and summary["steps"] == 7
    # The first run's best.pt is not in this run's directory: the best is chosen among this run's validations,
    # even when nothing is left to train (the checkpoint's step was validated in the first run only).
    assert summary["best_step"] == 7 and (tmp_path / "other" / "checkpoints" / "best.pt").is_file()
    again = compose_config(*FAST, "trainer.max_steps=6", "trainer.eval_every=6", f"ckpt_path={ckpts / 'step_00000006.pt'}",
                           run_dir=tmp_path / "again", cache_dir=shared_cache)
    summary = train(again)
    assert summary["steps"] == summary["best_step"] == 6 and summary["test_bleu"] >= 0
    with pytest.raises(ConfigError, match=r"^ckpt_path=/nonexistent.pt: no such file$"):
        train(fast_cfg("ckpt_path=/nonexistent.pt"))


@pytest.mark.slow
def test_a_run_resumed_in_its_directory_continues_its_wandb_run(fast_cfg, tmp_path, shared_cache):
    """trainer.resume=auto in the run's own directory (a requeued job) logs to the same W&B run: offline, both
    attempts' run files carry one id, the second from the step after the checkpoint. A run that starts from
    another run's checkpoint (ckpt_path) is a W&B run of its own."""
    steps = ["logger=wandb", "trainer.log_every=1", "trainer.save_every=2"]
    train(fast_cfg(*steps, "trainer.max_steps=4", "trainer.eval_every=4"))
    train(fast_cfg(*steps, "trainer.max_steps=6", "trainer.eval_every=6", "trainer.resume=auto"))
    run = tmp_path / "run"
    attempts = [read_wandb_run(f) for f in run.glob("wandb/offline-run-*/run-*.wandb")]
    first_steps = {tuple(row["_step"] for row in a["history"] if "loss" in row) for a in attempts}
    assert first_steps == {(1, 2, 3, 4), (5, 6)}
    run_id = (run / "wandb_run_id").read_text().strip()
    assert [a["run"].run_id for a in attempts] == [run_id, run_id]

    other = compose_config(*FAST, *steps, "trainer.max_steps=6", "trainer.eval_every=6",
                           f"ckpt_path={run / 'checkpoints' / 'step_00000004.pt'}", run_dir=tmp_path / "other",
                           cache_dir=shared_cache)
    assert train(other)["resumed_from"]["step"] == 4
    assert (tmp_path / "other" / "wandb_run_id").read_text().strip() != run_id


@pytest.mark.slow
def test_a_fresh_start_does_not_mix_with_an_earlier_runs_checkpoints(fast_cfg, tmp_path, caplog, shared_cache):
    """Without trainer.resume, a directory holding step checkpoints stops the run before anything is written. With
    resume=auto and none of them readable, or with resume=never, the run starts from step 0: the earlier run's
    checkpoints are removed, the metrics hold this run's rows alone, and W&B gets a new run (continuing the old one
    would log step 1 over step 6)."""
    steps = ["logger=wandb", "trainer.log_every=1", "trainer.save_every=2", "trainer.eval_every=6"]
    train(fast_cfg(*steps, "trainer.max_steps=6"))
    run = tmp_path / "run"
    first_id = (run / "wandb_run_id").read_text()
    with pytest.raises(ConfigError, match=r"checkpoints holds an earlier run's checkpoints \(newest step_00000006.pt\):"
                                          r" add trainer.resume=auto to continue that run"):
        train(fast_cfg(*steps, "trainer.max_steps=4"))
    assert (run / "wandb_run_id").read_text() == first_id and len(losses(run)) == 6

    for path in (run / "checkpoints").glob("*.pt"):  # best.pt too: an intact one would be resumed from
        path.write_bytes(path.read_bytes()[:1000])
    # none readable: resume=auto removes nothing and stops (it started over, removing them: a failure that is not
    # the files' own, the host out of memory say, cost the run)
    with pytest.raises(ConfigError, match=r"checkpoints: none of its 3 checkpoints can be read \(step_00000006.pt: "
                                          r".*; nothing was removed: trainer.resume=never starts over and removes them$"):
        train(fast_cfg(*steps, "trainer.max_steps=4", "trainer.eval_every=4", "trainer.resume=auto"))
    assert len(list((run / "checkpoints").glob("*.pt"))) == 4 and len(losses(run)) == 6  # best.pt among them
    with caplog.at_level(logging.WARNING):
        summary = train(fast_cfg(*steps, "trainer.max_steps=4", "trainer.eval_every=4", "trainer.resume=never"))
    assert "resumed_from" not in summary and summary["steps"] == 4
    assert any("removed the 3 checkpoints" in r.message for r in caplog.records)
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*.pt")) == ["step_00000002.pt", "step_00000004.pt"]
    assert sorted(losses(run)) == [1, 2, 3, 4]
    second_id = (run / "wandb_run_id").read_text()
    assert second_id != first_id

    # started over and killed before its first validation: nothing of the earlier run passes for this one's
    with pytest.raises(RuntimeError, match="injected failure"):
        train(fast_cfg(*steps, "trainer.max_steps=4", "trainer.resume=never", "fault.kind=error", "fault.at_step=1"))
    assert not (run / "checkpoints" / "best.pt").exists() and not (run / "test.hyp.txt").exists()
    assert json.loads((run / "summary.json").read_text())["status"] == "failed"  # this attempt's, not the earlier
    summary = train(fast_cfg(*steps, "trainer.max_steps=2", "trainer.eval_every=2", "trainer.resume=never"))
    assert "resumed_from" not in summary and summary["steps"] == 2
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*.pt")) == ["step_00000002.pt"]
    assert sorted(losses(run)) == [1, 2] and (run / "wandb_run_id").read_text() not in (first_id, second_id)

    # started over here from another run's checkpoint (ckpt_path, at step 4): the rows of this directory's earlier
    # run up to that step are not this run's history either
    other = compose_config(*FAST, *steps, "trainer.max_steps=4", run_dir=tmp_path / "other", cache_dir=shared_cache)
    train(other)
    summary = train(fast_cfg(*steps, "trainer.max_steps=6", "trainer.resume=never",
                             f"ckpt_path={tmp_path / 'other' / 'checkpoints' / 'step_00000004.pt'}"))
    assert summary["resumed_from"]["step"] == 4 and sorted(losses(run)) == [5, 6]


@pytest.mark.parametrize("policy", ["skip", "stop"])
def test_a_nan_loss_is_skipped_or_stops_the_run(fast_cfg, policy, tmp_path, shared_cache):
    cfg = fast_cfg("fault.kind=nan_loss", "fault.at_step=3", f"trainer.on_nonfinite={policy}", "trainer.log_every=1")
    if policy == "stop":
        with pytest.raises(NumericalError, match=r"^non-finite loss or gradient at step 3; stopped"):
            train(cfg)
        summary = json.loads((Path(cfg.paths.output_dir) / "summary.json").read_text())
        assert summary["status"] == "failed" and "step 3" in summary["error"]
        # the steps taken before it; its update was not skipped (it said "steps 3, 1 skipped")
        assert summary["steps"] == 2 and summary["nonfinite_skips"] == 0 and "test_bleu" not in summary
        assert load_checkpoint(Path(cfg.paths.output_dir) / "checkpoints" / "step_00000002.pt")["progress"]["step"] == 2
        return
    summary = train(cfg)
    assert summary["status"] == "completed" and summary["nonfinite_skips"] == 1 and summary["steps"] == 6
    rows = read_jsonl(Path(cfg.paths.output_dir) / "metrics.jsonl")
    assert all(r["loss"] == r["loss"] for r in rows if "loss" in r)  # no NaN reached the logged means
    assert {"step": 3, "nonfinite_skips": 1} in rows
    # the skipped step's tokens count toward the throughput, as its time does (its time counted, its tokens not)
    clean = compose_config(*FAST, "trainer.log_every=1", run_dir=tmp_path / "clean", cache_dir=shared_cache)
    train(clean)
    plain = read_jsonl(Path(clean.paths.output_dir) / "metrics.jsonl")
    assert sum(r["src_tokens"] for r in rows if "loss" in r) == sum(r["src_tokens"] for r in plain if "loss" in r)
    step4 = next(r for r in rows if r.get("step") == 4 and "loss" in r)
    assert step4["src_tokens"] == sum(r["src_tokens"] for r in plain if r.get("step") in (3, 4) and "loss" in r)


def test_a_run_stopped_by_a_nonfinite_step_resumes_from_the_step_before_it(fast_cfg, tmp_path, shared_cache):
    """A non-finite stop checkpoints the steps taken before it (they were lost back to the last scheduled
    checkpoint, all of them here), without the failed step: resumed with the cause mended, the run trains as one
    that never met it. (Without dropout: the failed step's dropout draw is not taken back.)"""
    common = ["trainer.log_every=1", "model.dropout=0", "trainer.max_steps=5", "trainer.eval_every=5"]
    with pytest.raises(NumericalError, match=r"^non-finite loss or gradient at step 3; stopped"):
        train(fast_cfg(*common, "fault.kind=nan_loss", "fault.at_step=3", "trainer.on_nonfinite=stop"))
    run = Path(fast_cfg().paths.output_dir)
    assert [p.name for p in (run / "checkpoints").glob("step_*.pt")] == ["step_00000002.pt"]
    resumed = train(fast_cfg(*common, "trainer.resume=auto"))
    clean = compose_config(*FAST, *common, run_dir=tmp_path / "clean", cache_dir=shared_cache)
    train(clean)
    assert resumed["resumed_from"]["step"] == 2 and resumed["steps"] == 5
    assert losses(run) == pytest.approx(losses(Path(clean.paths.output_dir)), rel=1e-6)
    assert resumed["test_bleu"] == json.loads((tmp_path / "clean" / "summary.json").read_text())["test_bleu"]


def test_too_many_nonfinite_steps_stop_the_run(fast_cfg, tmp_path, shared_cache):
    """trainer.max_nonfinite=N skips N non-finite steps and stops at the next: one skip is within 1, not within 0."""
    nan = ["fault.kind=nan_loss", "fault.at_step=2", "fault.times=1", "trainer.max_steps=3", "trainer.eval_every=3"]
    summary = train(compose_config(*FAST, *nan, "trainer.max_nonfinite=1", run_dir=tmp_path / "one",
                                   cache_dir=shared_cache))
    assert summary["status"] == "completed" and summary["nonfinite_skips"] == 1 and summary["steps"] == 3
    with pytest.raises(NumericalError, match=r"1 non-finite step, more than trainer.max_nonfinite=0 allows to skip"):
        train(fast_cfg(*nan, "trainer.max_nonfinite=0"))


def files_of(run: Path) -> dict[str, bytes]:
    return {str(f.relative_to(run)): f.read_bytes() for f in sorted(run.rglob("*")) if f.is_file()}


@pytest.mark.slow
def test_a_vocabulary_of_the_same_size_with_other_words_is_refused(fast_cfg):
    """Other data (data.seed=2) under a vocabulary cap: the sizes match, so the weights would load and train on
    with every embedding standing for another word (and the tokenizer files of the run would be rewritten)."""
    cfg = fast_cfg("tokenizer.max_vocab=60", "trainer.max_steps=2", "trainer.eval_every=2")
    train(cfg)
    codecs = (Path(cfg.paths.output_dir) / "tokenizer" / "codecs.json").read_bytes()
    with pytest.raises(ConfigError, match=r"step_00000002\.pt: written with another source and target vocabulary of "
                                          r"the same size \(its token ids stand for other words"):
        train(fast_cfg("tokenizer.max_vocab=60", "data.seed=2", "trainer.max_steps=4", "trainer.resume=auto"))
    assert (Path(cfg.paths.output_dir) / "tokenizer" / "codecs.json").read_bytes() == codecs
    again = train(fast_cfg("tokenizer.max_vocab=60", "trainer.max_steps=4", "trainer.resume=auto"))
    assert again["resumed_from"]["step"] == 2  # the same vocabulary, built again from the same data


@pytest.mark.slow
def test_a_checkpoint_of_another_model_is_refused_in_one_line_and_other_data_settings_are_named(fast_cfg, caplog):
    """Resuming with another model size, or with data whose vocabularies differ, stops before anything is loaded
    (load_state_dict's page of size mismatches; model.n_heads would load and compute something else), and leaves
    the run's directory as it was: its config, summary, metrics and tokenizer (which its checkpoints need to
    translate) are those of the run that wrote them. Another batch size resumes, with a warning that the run no
    longer repeats the one that wrote the checkpoint."""
    first = ["trainer.max_steps=2", "trainer.eval_every=2"]
    cfg = fast_cfg(*first)
    train(cfg)
    run = Path(cfg.paths.output_dir)
    before = files_of(run)
    again = ["trainer.max_steps=4", "trainer.eval_every=4", "trainer.resume=auto"]
    ckpt = r".*/checkpoints/step_00000002\.pt: written by another model "
    with pytest.raises(ConfigError, match=ckpt + r"\(model\.n_heads 4 there, 2 here\): resume with that run's "
                                                 r"settings \(its config\.yaml\), or start over \(trainer\.resume=never\)$"):
        train(fast_cfg(*again, "model.n_heads=2"))
    with pytest.raises(ConfigError, match=ckpt + r"\(src_vocab \d+ there, \d+ here, tgt_vocab \d+ there, \d+ here\); the "
                                                 r"data or tokenizer settings differ from that run's"):
        train(fast_cfg(*again, "data.train_size=600"))
    after = files_of(run)
    assert [k for k in before if after.get(k) != before[k]] == [] and after.keys() == before.keys()
    (run / "summary.json").unlink()  # as a killed run leaves it: its checkpoints alone say it is there
    with pytest.raises(ConfigError, match=ckpt):
        train(fast_cfg(*again, "model.n_heads=2"))
    assert not (run / "summary.json").exists()
    with caplog.at_level(logging.WARNING, logger="src.state"):
        summary = train(fast_cfg(*again, "data.batch_size=8", "model.dropout=0.0"))  # dropout: free to change
    assert summary["status"] == "completed" and summary["resumed_from"]["step"] == 2
    assert [r.message.split(": ", 1)[1] for r in caplog.records if "resumed with other" in r.message] == [
        "resumed with other data settings than the run that wrote it; the rest of this run will not be the one that "
        "run would have trained"]


@pytest.mark.slow
def test_resumed_mid_epoch_with_another_batch_size_the_epoch_still_trains_each_pair_once(fast_cfg, monkeypatch):
    """Stopped 2 batches of 16 into an epoch, resumed with batches of 8: the epoch's batches of 8 go on without
    the 32 pairs already trained (skipping the first 2 batches of the new order trained some pairs twice and
    missed others). Resumed again within that epoch, the same."""
    import src.run

    step, seen = src.run.TrainingRun.train_step, []

    def recorded(self, indices, real, group):
        seen.append((self.p.epoch, [i for b in group for i in b]))
        return step(self, indices, real, group)

    monkeypatch.setattr(src.run.TrainingRun, "train_step", recorded)
    common = ["trainer.eval_every=1000", "trainer.log_every=1", "trainer.max_epochs=1"]
    train(fast_cfg(*common, "trainer.max_steps=2"))
    train(fast_cfg(*common, "trainer.max_steps=10", "trainer.resume=auto", "data.batch_size=8"))
    summary = train(fast_cfg(*common, "trainer.max_steps=200", "trainer.resume=auto", "data.batch_size=8"))
    assert summary["status"] == "completed" and summary["steps"] > 10
    pairs = [i for epoch, group in seen if epoch == 0 for i in group]
    assert sorted(pairs) == list(range(300)), (len(pairs), len(set(pairs)))
    assert max(len(group) for _, group in seen[2:]) == 8


@pytest.mark.parametrize("overfit", [None, 2])
def test_each_epochs_batches_are_made_once_and_trained_in_that_epochs_order(fast_cfg, monkeypatch, overfit):
    """12 steps over 10 batches an epoch: the run counts the first epoch's steps at its start, then trains them,
    from one order (it was made twice, 0.4-0.6 s each at 4.5M pairs); the second epoch trains its own. With
    trainer.overfit_batches, every epoch trains the first epoch's first batches, made once."""
    import src.run

    made, seen, make, step = {}, [], src.run.epoch_batches, src.run.TrainingRun.train_step

    def making(*args, epoch: int, **kwargs):
        made.setdefault(epoch, []).append(make(*args, epoch=epoch, **kwargs))
        return made[epoch][-1]

    def recorded(self, indices, real, group):
        seen.append((self.p.epoch, *group))
        return step(self, indices, real, group)

    monkeypatch.setattr(src.run, "epoch_batches", making)
    monkeypatch.setattr(src.run.TrainingRun, "train_step", recorded)
    overrides = ["data.batch_size=32", "trainer.max_steps=12", "trainer.eval_every=12"]
    summary = train(fast_cfg(*overrides, *([f"trainer.overfit_batches={overfit}"] if overfit else [])))
    assert summary["status"] == "completed" and summary["steps"] == len(seen) == 12
    assert {epoch: len(orders) for epoch, orders in made.items()} == ({0: 1} if overfit else {0: 1, 1: 1})
    epochs = sorted({epoch for epoch, _ in seen})
    assert epochs == list(range(6 if overfit else 2))
    for epoch in epochs:
        trained = [batch for e, batch in seen if e == epoch]
        assert trained == made[0 if overfit else epoch][0].tolist()[:len(trained)]
        assert len(trained) == (overfit or (10 if epoch == 0 else 2))


def test_a_run_without_fp16_resumes_with_fp16_and_a_failed_load_leaves_the_run_as_it_was(fast_cfg, monkeypatch):
    """A checkpoint written without fp16 holds no GradScaler state: resumed with memory.amp=fp16 (a memory setting:
    it resumes, with a warning) the run starts a new scaler; it used to fail in GradScaler.load_state_dict. And
    the run's files become the resumed run's only once its checkpoint is loaded: a load that fails leaves the
    earlier run's config, summary and metrics as they were (they were rewritten before the load)."""
    cfg = fast_cfg("trainer.max_steps=2", "trainer.eval_every=2")
    train(cfg)
    run = Path(cfg.paths.output_dir)
    before = files_of(run)
    again = ["trainer.max_steps=4", "trainer.eval_every=4", "trainer.resume=auto", "memory=amp", "memory.amp=fp16"]

    def fails(*args, **kwargs):
        raise RuntimeError("the optimizer's state does not fit")

    with monkeypatch.context() as m:
        m.setattr(src.run, "load_full_state", fails)
        with pytest.raises(RuntimeError, match="does not fit"):
            train(fast_cfg(*again))
    assert files_of(run) == before
    summary = train(fast_cfg(*again))
    assert summary["status"] == "completed" and summary["resumed_from"]["step"] == 2 and summary["steps"] == 4
    assert summary["strategy"] == "amp"


def test_a_checkpoint_from_before_batches_were_counted_resumes_at_its_batch():
    """Checkpoints written before 2026-12-02 counted the epoch's optimizer steps, one batch per rank."""
    from src.state import Progress

    old = Progress().to_dict()
    del old["batches_done"]
    one, two = ({"progress": {**old, "batch_in_epoch": 3}, "rng_ranks": ranks} for ranks in (None, [{}, {}]))
    assert Progress.from_checkpoint(one, 8).batches_done == 3 and Progress.from_checkpoint(two, 8).batches_done == 6


def test_a_run_started_from_another_runs_checkpoint_resumes_from_its_own(fast_cfg, tmp_path, shared_cache):
    """Fine-tuning from ckpt_path, requeued (or rerun with trainer.resume=auto): the run continues from its own
    newest checkpoint, not from the checkpoint it started from (it did, and trained its steps again)."""
    first = fast_cfg("trainer.max_steps=2", "trainer.eval_every=2")
    train(first)
    start = Path(first.paths.output_dir) / "checkpoints" / "step_00000002.pt"
    tuned = ["trainer.eval_every=2", "trainer.resume=auto", f"ckpt_path={start}"]
    run = tmp_path / "tuned"
    summary = train(compose_config(*FAST, *tuned, "trainer.max_steps=4", run_dir=run, cache_dir=shared_cache))
    assert summary["resumed_from"] == {"path": str(start), "step": 2}
    summary = train(compose_config(*FAST, *tuned, "trainer.max_steps=6", run_dir=run, cache_dir=shared_cache))
    assert summary["resumed_from"] == {"path": str(run.resolve() / "checkpoints" / "step_00000004.pt"), "step": 4}
    assert summary["steps"] == 6


def test_a_run_started_from_another_runs_checkpoint_in_a_used_directory_starts_it_afresh(fast_cfg, tmp_path,
                                                                                          shared_cache):
    """ckpt_path into a directory that holds an earlier run's checkpoints: as a fresh start there, the run stops
    naming them unless told trainer.resume=never, which removes them. They stayed, mixed with the new run's:
    pruning and average_last took them for its own."""
    other = fast_cfg("trainer.max_steps=4", "trainer.eval_every=4")
    train(other)
    start = Path(other.paths.output_dir) / "checkpoints" / "step_00000004.pt"
    run = tmp_path / "used"
    common = [*FAST, "trainer.eval_every=2", "trainer.save_every=2"]
    train(compose_config(*common, "trainer.max_steps=2", run_dir=run, cache_dir=shared_cache))  # step_2, best.pt
    with pytest.raises(ConfigError, match="holds an earlier run's checkpoints"):
        train(compose_config(*common, "trainer.max_steps=6", f"ckpt_path={start}", run_dir=run,
                             cache_dir=shared_cache))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["best.pt", "step_00000002.pt"]  # untouched
    summary = train(compose_config(*common, "trainer.max_steps=6", f"ckpt_path={start}", "trainer.resume=never",
                                   run_dir=run, cache_dir=shared_cache))
    assert summary["resumed_from"] == {"path": str(start), "step": 4} and summary["best_step"] == 6
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["best.pt", "step_00000006.pt"]


def test_a_best_checkpoint_written_after_the_resumed_one_is_not_the_runs(fast_cfg):
    """A run resumed from one of its step checkpoints (ckpt_path) older than its best.pt: here to stop at that
    checkpoint's step, it validates and tests its own model, not the best.pt of the steps it no longer has.
    (resume=auto continues from such a best.pt, the newest state: test_resume_auto_continues_from_best_pt...)"""
    cfg = fast_cfg("trainer.max_steps=6", "trainer.eval_every=2", "trainer.save_every=4")
    train(cfg)
    ckpts = Path(cfg.paths.output_dir) / "checkpoints"
    (ckpts / "step_00000006.pt").replace(ckpts / "best.pt")  # the best.pt of step 6
    summary = train(fast_cfg("trainer.max_steps=4", "trainer.eval_every=2", "trainer.save_every=4",
                             f"ckpt_path={ckpts / 'step_00000004.pt'}"))
    assert summary["resumed_from"]["step"] == 4 and summary["best_step"] == 4
    assert load_checkpoint(ckpts / "best.pt")["progress"]["step"] == 4


def test_an_unreadable_best_checkpoint_is_replaced_not_tested(fast_cfg):
    """best.pt damaged on disk: the resumed run removes it and chooses its best among its own validations, instead
    of failing when it tests best.pt at the end."""
    train(fast_cfg("trainer.max_steps=4", "trainer.eval_every=2"))
    cfg = fast_cfg("trainer.max_steps=6", "trainer.eval_every=2", "trainer.resume=auto")
    best = Path(cfg.paths.output_dir) / "checkpoints" / "best.pt"
    damaged = best.read_bytes()[:1000]
    best.unlink()  # best.pt alone: it may be step_00000004.pt under a second name (a hard link), intact here
    best.write_bytes(damaged)
    summary = train(cfg)
    assert summary["status"] == "completed" and summary["resumed_from"]["step"] == 4 and summary["best_step"] == 6
    assert load_checkpoint(best)["progress"]["step"] == 6


def test_step_checkpoints_written_after_the_resumed_one_are_removed(fast_cfg):
    """Resumed from an older checkpoint of its directory, a run removes the later ones the earlier attempt left:
    pruning kept them (the highest step numbers) over this run's own, and average_last averaged them in."""
    first = ["trainer.max_steps=6", "trainer.eval_every=2"]
    cfg = fast_cfg(*first)
    train(cfg)
    ckpts = Path(cfg.paths.output_dir) / "checkpoints"
    summary = train(fast_cfg("trainer.max_steps=4", "trainer.eval_every=2", "trainer.average_last=2",
                             f"ckpt_path={ckpts / 'step_00000002.pt'}", "optim.lr=1e-2"))
    assert summary["test_checkpoints"] == ["step_00000002.pt", "step_00000004.pt"]
    assert sorted(p.name for p in ckpts.glob("*.pt")) == ["best.pt", "step_00000002.pt", "step_00000004.pt"]
    assert load_checkpoint(ckpts / "step_00000004.pt")["config"]["optim"]["lr"] == 1e-2  # this run's own


def test_random_states_of_more_gpus_than_are_visible_are_restored_for_those_visible(monkeypatch):
    """A checkpoint of an 8-GPU node resumed on 2 GPUs: their two CUDA generators are restored (restoring all 8
    indexed generators that do not exist)."""
    from src.state import rng_state, set_rng_state

    state = {**rng_state(), "cuda": [torch.tensor([i]) for i in range(8)]}
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.extend)
    set_rng_state(state)
    assert restored == state["cuda"][:2]



def test_each_rank_resumes_its_own_random_stream_whatever_the_number_of_ranks():
    """A rank continues the stream it saved; a rank the checkpoint did not have draws a new one of its own, from
    (seed, step, rank). All ranks took rank 0's stream when the number of ranks changed, and drew the same dropout
    masks."""
    from src.state import restore_rng_state, rng_state

    def saved(n: int) -> dict:
        """A checkpoint written by ``n`` ranks (one process: ``rng`` alone), with each rank's stream."""
        streams = []
        for rank in range(n):
            torch.manual_seed(100 + rank)
            streams.append(rng_state())
        return {"rng": streams[0], "rng_ranks": streams if n > 1 else None, "progress": {"step": 7}}

    def draws(ckpt: dict, ranks: int, seed: int = 1) -> list[tuple]:
        out = []
        for rank in range(ranks):
            continued = restore_rng_state(ckpt, rank, seed)
            out.append((continued, tuple(torch.rand(3).tolist())))
        return out

    def stream(rank: int) -> tuple:
        torch.manual_seed(100 + rank)
        return tuple(torch.rand(3).tolist())

    for written, resumed in ((1, 1), (2, 2), (2, 1), (1, 2), (2, 4)):
        got = draws(saved(written), resumed)
        assert [c for c, _ in got] == [rank < written for rank in range(resumed)], (written, resumed)
        assert [d for c, d in got if c] == [stream(rank) for rank in range(min(written, resumed))]
        assert len({d for _, d in got}) == resumed, (written, resumed)  # no two ranks draw the same numbers
        assert got == draws(saved(written), resumed)  # and a new stream is the same on every resume
    assert draws(saved(1), 2, seed=1)[1] != draws(saved(1), 2, seed=2)[1]


def test_a_fault_acts_at_its_step_alone_and_times_0_keeps_it_off():
    """A run resumed past fault.at_step with the same command line (a requeued SLURM job) does not get the fault
    again; fault.times=0 keeps a fault configured but off."""
    from src.faults import Fault, check_fault

    fault = Fault("error", at_step=2, times=5)
    fault.maybe_raise(1)
    fault.maybe_raise(3)  # past its step: nothing
    with pytest.raises(RuntimeError, match="fault injected at step 2"):
        fault.maybe_raise(2)
    check_fault({"kind": "error", "at_step": 2, "times": 0})
    Fault("error", at_step=2, times=0).maybe_raise(2)
    with pytest.raises(ConfigError, match=r"^fault.times=-1: must be an integer >= 0$"):
        check_fault({"kind": "error", "times": -1})
    # under torchrun, fault.rank alone fails; without it, every rank
    from src.faults import fault_settings

    on_rank_1 = {"fault": {"kind": "oom", "at_step": 3, "rank": 1}}
    assert [fault_settings(on_rank_1, rank)["kind"] for rank in (0, 1, 2)] == [None, "oom", None]
    assert fault_settings({"fault": {"kind": "oom"}}, 2)["kind"] == "oom"


def test_a_fault_step_without_a_kind_is_said_to_inject_nothing(caplog):
    from src.faults import check_fault

    check_fault({"kind": None, "at_step": 1, "times": 1, "rank": None})  # the defaults: silent
    assert not caplog.records
    check_fault({"kind": None, "at_step": 3, "times": 1, "rank": 1})
    assert caplog.records[0].getMessage().startswith(
        "fault.at_step=3 fault.rank=1 without fault.kind: nothing is injected (fault.kind=oom|")


def test_a_run_directory_names_the_checkpoints_it_tested_with_or_its_best(tmp_path):
    """translate.py <run dir>: summary.json's test_checkpoints when every one of them is there, else best.pt (one
    deleted to save space would otherwise fail as "not found"); a dict with weights but no model settings is one
    line, not a KeyError."""
    from src.checkpoint import checkpoint_files, read_checkpoint
    from src.errors import UserError

    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    for name in ("best.pt", "step_00000004.pt", "step_00000006.pt"):
        torch.save({"model": {}, "model_args": {}}, ckpts / name)
    (tmp_path / "summary.json").write_text(json.dumps({"test_checkpoints": ["step_00000004.pt", "step_00000006.pt"]}))
    assert checkpoint_files(tmp_path) == [ckpts / "step_00000004.pt", ckpts / "step_00000006.pt"]
    (ckpts / "step_00000004.pt").unlink()
    assert checkpoint_files(tmp_path) == [ckpts / "best.pt"]
    torch.save({"model": {}}, tmp_path / "weights.pt")
    with pytest.raises(UserError, match="not a checkpoint written by train.py"):
        read_checkpoint(tmp_path / "weights.pt", torch.device("cpu"))


def test_a_second_process_in_a_live_runs_directory_is_refused_and_writes_nothing(fast_cfg):
    """Two runs given one directory (a job launched twice, hydra.run.dir given twice): the second is refused in
    one line while the first runs, and writes nothing there (it resumed the live run's checkpoints, removed those
    written since and interleaved its files with the live run's); once the first has ended, the directory is free."""
    import contextlib
    import os

    from src.run import RUN_LOCK, RunDirBusy, hold_run_dir

    cfg = fast_cfg("trainer.max_steps=2", "trainer.eval_every=2")
    run_dir = Path(cfg.paths.output_dir).resolve()
    run_dir.mkdir(parents=True)
    with contextlib.ExitStack() as live:
        hold_run_dir(run_dir, live)  # as the live run holds it (a lock of another open file: flock's own rules)
        with pytest.raises(RunDirBusy, match=rf"^{run_dir}: another process is running in this directory "
                                             rf"\(pid {os.getpid()} on .+\); give this run its own"):
            train(cfg)
        assert sorted(p.name for p in run_dir.iterdir()) == [RUN_LOCK]
    assert train(cfg)["status"] == "completed"


@pytest.mark.slow
def test_jobs_that_miss_the_encoded_corpus_cache_together_tokenize_once(tmp_path):
    """A sweep's jobs started at once on a cluster: the first holds the cache file's lock while it tokenizes and
    writes, and a job that missed the cache meanwhile waits, then loads that file rather than tokenizing again. A
    temporary file that a writer killed mid-write left behind is removed by the next writer."""
    import threading

    from omegaconf import OmegaConf

    from src.data.encode import _encoded, cache_key, encode_corpus
    from src.data.prepare import load_corpus
    from src.fileio import locked

    conf = OmegaConf.to_container(compose_config(*FAST, run_dir=tmp_path / "run"), resolve=True)
    cache = tmp_path / "cache"
    cache.mkdir()
    corpus = load_corpus(conf["data"], cache, True)
    cache_file = cache / f"encoded-{cache_key(corpus, conf['tokenizer'])}.pt"
    lock = cache / f".{cache_file.name}.lock"
    loaded: list = []
    with locked(lock, wait=False) as first:  # the first job, tokenizing
        assert first
        with locked(lock, wait=False) as second:
            assert not second  # another holder: said at once, without waiting
        waiting = threading.Thread(target=lambda: loaded.append(encode_corpus(corpus, conf["tokenizer"], cache)))
        waiting.start()
        waiting.join(timeout=1)
        assert waiting.is_alive() and not loaded  # the second job waits for the first
        _encoded(corpus, conf["tokenizer"], cache_file)  # the first job writes the cache
    waiting.join(timeout=60)
    assert loaded and loaded[0].from_cache  # loaded, not tokenized again
    cache_file.unlink()
    stale = cache / f".{cache_file.name}.x1y2.tmp"
    stale.write_bytes(b"half a file")  # a writer killed mid-write
    assert not encode_corpus(corpus, conf["tokenizer"], cache).from_cache and not stale.exists()


def test_the_pairs_trained_in_an_epoch_are_saved_as_one_tensor_and_load_from_either_form(tmp_path):
    """Progress.trained, a bool per training pair, is the indices of the pairs trained in the checkpoint, one int32
    tensor (as a list of millions of ints, late in an epoch of a WMT-sized corpus, it took seconds to copy, save and
    load in every checkpoint); a checkpoint that holds the list (before 2026-12-04) still resumes, and an index past
    the corpus (a checkpoint of a larger one) marks nothing."""
    from src.checkpoint import save_checkpoint
    from src.state import Progress, trained_mask

    progress = Progress(step=3, trained=trained_mask([7, 2, 5], 9))
    assert progress.trained.tolist() == [i in (2, 5, 7) for i in range(9)]
    saved = progress.to_dict()
    assert saved["trained"].dtype == torch.int32 and saved["trained"].tolist() == [2, 5, 7]
    save_checkpoint(tmp_path / "new.pt", progress=saved)
    save_checkpoint(tmp_path / "old.pt", progress={**saved, "trained": [7, 2, 5]})
    for name in ("new.pt", "old.pt"):
        loaded = Progress.from_checkpoint(load_checkpoint(tmp_path / name), 9)
        assert loaded == progress and torch.equal(loaded.trained, progress.trained)
    assert Progress.from_checkpoint(load_checkpoint(tmp_path / "new.pt"), 6).trained.nonzero().flatten().tolist() == [2, 5]
    # and one from before Progress.trained (2026-12-03): nothing marked, as before
    save_checkpoint(tmp_path / "older.pt", progress={k: v for k, v in saved.items() if k != "trained"})
    older = Progress.from_checkpoint(load_checkpoint(tmp_path / "older.pt"), 9)
    assert older == Progress(step=3) and not older.trained.any() and len(older.trained) == 9


def test_a_best_pt_unreadable_for_a_moment_is_kept_and_a_damaged_one_removed(tmp_path, monkeypatch):
    """Resumed at step 4, best.pt goes when it is later (an attempt that stopped wrote it) or damaged, and stays
    when written at step 4 or before; a read that fails for the disk's or the host's reasons, not the file's, must
    not cost the run its best model."""
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    best = ckpts / "best.pt"
    torch.save({"progress": {"step": 2}}, best)
    load = torch.load

    def failing(path, *args, **kwargs):
        if Path(path).name == "best.pt":
            raise OSError(5, "Input/output error")
        return load(path, *args, **kwargs)

    monkeypatch.setattr(torch, "load", failing)
    assert drop_later_checkpoints(ckpts, 4) == [] and best.is_file()
    monkeypatch.setattr(torch, "load", load)
    assert drop_later_checkpoints(ckpts, 4) == [] and best.is_file()  # step 2: this run's
    torch.save({"progress": {"step": 4}}, best)
    assert drop_later_checkpoints(ckpts, 4) == [] and best.is_file()  # the resumed step's own validation's
    torch.save({"progress": {"step": 5}}, best)
    assert drop_later_checkpoints(ckpts, 4) == [best] and not best.exists()
    torch.save({"progress": {"step": 2}}, best)
    best.write_bytes(best.read_bytes()[:100])
    assert drop_later_checkpoints(ckpts, 4) == [best] and not best.exists()
    # the step checkpoints after step 4 go, the very next one's included (a signal's stop at step 5)
    steps = {n: ckpts / f"step_{n}.pt" for n in (3, 4, 5, 8)}
    for path in steps.values():
        path.write_bytes(b"")
    assert drop_later_checkpoints(ckpts, 4) == [steps[8], steps[5]]
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_3.pt", "step_4.pt"]


class _Rank:
    """A rank of a torchrun job, whose broadcast hands it rank 0's value."""
    def __init__(self, rank: int, rank_0s):
        self.rank, self.size, self.distributed, self.rank_0s = rank, 2, True, rank_0s

    def broadcast(self, obj):
        return obj if self.rank == 0 else self.rank_0s


def test_every_rank_resumes_from_rank_0s_checkpoint(tmp_path):
    """Each rank picks the newest checkpoint it can read: one that could not read the newest for a moment takes
    rank 0's, or the run stops; it never trains on from another step than rank 0."""
    newest, older = tmp_path / "step_00000006.pt", tmp_path / "step_00000004.pt"
    for step, path in ((6, newest), (4, older)):
        torch.save({"progress": {"step": step}}, path)
    rank_0s = str(newest.resolve())
    path, state = same_checkpoint_on_every_rank(_Rank(1, rank_0s), (older, {"progress": {"step": 4}}))
    assert path == newest and state["progress"]["step"] == 6
    assert same_checkpoint_on_every_rank(_Rank(1, None), (older, {})) is None  # rank 0 starts afresh: so does it
    assert same_checkpoint_on_every_rank(_Rank(0, rank_0s), (newest, {"x": 1})) == (newest, {"x": 1})
    newest.write_bytes(b"PK\x03\x04")
    with pytest.raises(ConfigError, match=r"step_00000006.pt: rank 0 resumes from it, rank 1 cannot read it \("):
        same_checkpoint_on_every_rank(_Rank(1, rank_0s), (older, {}))


def test_a_cpu_run_on_a_gpu_machine_starts_no_cuda_context(fast_cfg, monkeypatch):
    """trainer.device=cpu where a GPU is visible: batches are not pinned (page-locked memory is for copies to a
    GPU, and pinning starts a CUDA context) and checkpoints hold no CUDA generators (reading them starts one)."""
    def no_cuda(*args, **kwargs):
        raise AssertionError("a CUDA call in a CPU run")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("get_rng_state_all", "init"):
        monkeypatch.setattr(torch.cuda, name, no_cuda)
    monkeypatch.setattr(torch.Tensor, "pin_memory", no_cuda)
    summary = train(fast_cfg("trainer.device=cpu", "trainer.max_steps=2", "trainer.save_every=2"))
    assert summary["status"] == "completed" and summary["device"] == "cpu"


def test_the_best_checkpoint_is_the_validation_with_the_highest_bleu(fast_cfg, tmp_path, monkeypatch):
    """Validations scoring 5, 30 and 10 BLEU: best.pt is the second's, and the summary's valid scores are its (in
    tiny runs every validation scores about 0, so a comparison of the wrong sign passed every other test)."""
    validate, given = src.run.TrainingRun.validate, iter([5.0, 30.0, 10.0])

    def scored(self, m):
        return {**validate(self, m), "bleu": next(given)}

    monkeypatch.setattr(src.run.TrainingRun, "validate", scored)
    summary = train(fast_cfg("trainer.max_steps=9", "trainer.eval_every=3"))
    assert summary["best_step"] == 6 and summary["valid_bleu"] == 30.0
    best = load_checkpoint(tmp_path / "run" / "checkpoints" / "best.pt")
    assert best["progress"]["step"] == 6 and best["progress"]["best_bleu"] == 30.0


@pytest.mark.slow
def test_a_resumed_fp16_run_continues_with_the_checkpoints_loss_scale(fast_cfg, tmp_path, monkeypatch):
    """The GradScaler's scale (and its growth tracker) is part of the state a run resumes: started again at 2^16,
    a run whose scale had backed off to 2^10 would skip steps to overflow again."""
    fp16 = ["memory=amp", "memory.amp=fp16", "trainer.save_every=2"]
    train(fast_cfg(*fp16, "trainer.max_steps=4"))
    path = tmp_path / "run" / "checkpoints" / "step_00000004.pt"
    ckpt = load_checkpoint(path)
    ckpt["scaler"] = {**ckpt["scaler"], "scale": 1024.0, "_growth_tracker": 7}
    torch.save(ckpt, path)
    resume, seen = src.run.TrainingRun._resume, []

    def resuming(self, *args):
        resume(self, *args)
        seen.append(self.trainer.scaler.state_dict())

    monkeypatch.setattr(src.run.TrainingRun, "_resume", resuming)
    assert train(fast_cfg(*fp16, "trainer.max_steps=6", "trainer.resume=auto"))["resumed_from"]["step"] == 4
    assert seen[0]["scale"] == 1024.0 and seen[0]["_growth_tracker"] == 7


def test_a_checkpoint_given_with_nan_weights_is_refused_in_one_line(fast_cfg, tmp_path):
    """ckpt_path naming a checkpoint whose weights hold NaN (bytes changed on disk that still load): refused, as
    resume=auto passes over such a file; resumed, every step would be skipped as non-finite."""
    train(fast_cfg("trainer.max_steps=2", "trainer.save_every=2"))
    ckpt = load_checkpoint(tmp_path / "run" / "checkpoints" / "step_00000002.pt")
    name = next(iter(ckpt["model"]))
    ckpt["model"][name] = torch.full_like(ckpt["model"][name], float("nan"))
    torch.save(ckpt, tmp_path / "nan.pt")
    with pytest.raises(ConfigError, match=rf"^ckpt_path=\S+nan\.pt: {re.escape(name)} holds NaN or infinite values$"):
        train(compose_config(*FAST, f"ckpt_path={tmp_path / 'nan.pt'}", run_dir=tmp_path / "other",
                             cache_dir=tmp_path / "cache"))


def test_checkpoints_of_one_run_that_record_no_step_are_averaged(tmp_path):
    """averaged_checkpoint refuses a step given twice (best.pt beside its step checkpoint), told by the run and the
    step each records; checkpoints that record no step (written before `progress` was kept) cannot be told apart
    that way, and are averaged."""
    from src.checkpoint import averaged_checkpoint
    from src.errors import UserError

    def write(name: str, weight: float, step: int | None) -> Path:
        ckpt = {"model": {"w": torch.tensor([weight])}, "model_args": {"d_model": 8}, "config": {"paths": {
            "output_dir": "/runs/a"}}}
        if step is not None:
            ckpt["progress"] = {"step": step}
        torch.save(ckpt, tmp_path / name)
        return tmp_path / name

    old = [write("old1.pt", 1.0, None), write("old2.pt", 3.0, None)]
    assert averaged_checkpoint(old, torch.device("cpu"))["model"]["w"].item() == 2.0
    new = [write("step_4.pt", 1.0, 4), write("best.pt", 1.0, 4)]
    with pytest.raises(UserError, match=r"best.pt: step 4 of the same run as .*step_4.pt"):
        averaged_checkpoint(new, torch.device("cpu"))
