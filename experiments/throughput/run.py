"""The throughput reference workload, timed: `python experiments/throughput/run.py [--root DIR] [--base]`.

Runs `python train.py experiment=throughput_ref` (Multi30k de->en, 3+3 layers, d_model 256, batches of 2,000
tokens, 300 steps, then greedy decoding of test_2016_flickr) and reads back its files: training tokens/s and
seconds per step after 20 warm-up steps, peak RSS, the training loss at the last step, test BLEU and the test
decoding time. It also reads the model FLOPs of the timed steps that the run logs (``model_tflops`` per log line,
``ModelArgs.training_flops``: forward and backward on each batch as computed, padding included, attention too), and
measures this machine's fp32 matrix-multiply rate, so the achieved FLOP/s is stated as a fraction of what the matrix
products reach here. With --base the same is measured for model=base (6+6, d_model 512) over a shorter run. Writes
results.md and results.json next to this file (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from src.fileio import write_json, write_text  # noqa: E402
from src.flops import matmul_rate  # noqa: E402

WARMUP = 20
BASE = ["model.encoder_layers=6", "model.decoder_layers=6", "model.d_model=512", "model.n_heads=8", "model.d_ff=2048"]


def commit() -> str:
    """The commit measured, with ``+changes`` when the working tree differs from it ("unknown" without git)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True)
    except OSError:
        return "unknown"
    if head.returncode:
        return "unknown"
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


class TrainFailed(RuntimeError):
    """A train.py run that exited non-zero: its command and the end of its output."""


def run_train(run_dir: Path, overrides: list[str]) -> dict:
    cmd = [sys.executable, "train.py", "experiment=throughput_ref", "trainer.progress=false",
           f"hydra.run.dir={run_dir}", *overrides]
    started = time.perf_counter()
    # one stream: train.py logs its one-line errors through Hydra's logger, to standard output
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode:
        raise TrainFailed(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stdout[-3000:].rstrip()}")
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if any("mem_parameters_mb" in r for r in rows):  # the tensor tracker's split: it counted steps
        # which are timed apart (src/window.py): a row's rates would not be those of its window_s
        raise TrainFailed(f"{run_dir}: timed with trainer.track_memory=true; keep the preset's false to time steps")
    train = [r for r in rows if "loss" in r]
    # the windows logged after the first row at or past the warm-up: none of the warm-up steps is timed
    start = next((r["step"] for r in train if r["step"] >= WARMUP), None)
    timed = [r for r in train if start is not None and r["step"] > start]
    if not timed:  # raised, not an exit: gpu.py records it and goes on to its other parts
        raise TrainFailed(f"{run_dir}: no steps were logged after the {WARMUP} warm-up steps ({summary['steps']} "
                          "steps in all); train for more")
    seconds = sum(r["window_s"] for r in timed)
    steps = timed[-1]["step"] - start
    flops = sum(r["model_tflops"] * 1e12 * r["window_s"] for r in timed)
    return {
        "command": "python " + " ".join(cmd[1:]), "wall_s": round(time.perf_counter() - started, 1),
        "tokens_per_s": round(sum(r["src_tokens"] + r["tgt_tokens"] for r in timed) / seconds, 1),
        # the words alone: each side's </s> left out (in the tokens, one per side and pair; 7.3% of Multi30k's)
        "words_per_s": round(sum(r["src_tokens"] + r["tgt_tokens"] - 2 * r["pairs"] for r in timed) / seconds, 1),
        "timed_after_step": start,
        "s_per_step": round(seconds / steps, 4), "gflops_per_step": round(flops / steps / 1e9, 2),
        "achieved_gflops": round(flops / seconds / 1e9, 1), "steps": summary["steps"],
        "loss_last": round(train[-1]["loss"], 4),
        "peak_rss_mb": summary["peak_rss_mb"], "test_bleu": summary["test_bleu"], "valid_bleu": summary["valid_bleu"],
        "test_decode_s": summary["test_decode_s"], "padding_ratio": summary["padding_ratio"],
        "parameters": summary["parameters"], "vocab": summary["vocab"],
        # where this run tokenized the corpus: the peak RSS of the child process that did (not in peak_rss_mb)
        "tokenizing_peak_rss_mb": summary.get("encode_peak_rss_mb"),
    }


def reference(overrides: list[str]) -> tuple[dict, object, object, object]:
    """The reference workload's resolved config with ``overrides``, its memory strategy, its encoded corpus and
    its training split, prepared as train.py prepares them."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from src.data.prepare import prepare_data
    from src.memory import memory_strategy

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["experiment=throughput_ref", "paths.output_dir=.", *overrides])
    conf = OmegaConf.to_container(cfg, resolve=True)
    strategy = memory_strategy(conf["memory"], conf["data"].get("max_tokens"))
    _, encoded, split, _ = prepare_data(conf, strategy, download_ok=False)
    return conf, strategy, encoded, split


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default=os.environ.get("MULTI30K_ROOT") or str(ROOT.parent / "shared/data/multi30k"))
    parser.add_argument("--base", action="store_true", help="also model=base (6+6, d_model 512) for --base-steps")
    parser.add_argument("--base-steps", type=int, default=60)
    parser.add_argument("--extra", nargs="*", default=[], help="overrides added to every run, e.g. trainer.compile=true")
    parser.add_argument("--out", default=str(Path(__file__).parent))
    args = parser.parse_args()
    steps = [int(o.split("=")[1]) for o in args.extra if o.startswith("trainer.max_steps=") and o[18:].isdigit()]
    if args.base and args.base_steps <= WARMUP or any(n <= WARMUP for n in steps):
        parser.error(f"the runs are timed after {WARMUP} warm-up steps: give --base-steps and trainer.max_steps "
                     f"above {WARMUP}")
    os.environ["MULTI30K_ROOT"] = args.root
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    runs = ROOT / "outputs" / "throughput" / stamp
    rate = matmul_rate(torch.float32)
    print(f"fp32 matrix products: {rate / 1e9:.0f} GFLOP/s ({torch.get_num_threads()} threads)", flush=True)

    results = {"date": time.strftime("%Y-%m-%d"), "commit": commit(),
               "machine": f"{platform.machine()}, {os.cpu_count()} cores",
               "torch": torch.__version__, "threads": torch.get_num_threads(), "matmul_fp32_gflops": round(rate / 1e9, 1)}
    configs = {"reference": [*args.extra]}
    if args.base:
        configs["model=base"] = [*BASE, f"trainer.max_steps={args.base_steps}", f"trainer.eval_every={args.base_steps}",
                                 *args.extra]
    for name, overrides in configs.items():
        try:
            r = run_train(runs / name.replace("=", "_"), overrides)
        except TrainFailed as e:
            sys.exit(f"error: {e}")
        r["fraction_of_matmul_rate"] = round(r["achieved_gflops"] * 1e9 / rate, 3)
        results[name] = r
        print(name, r, flush=True)
        write(results, [n for n in configs if n in results], Path(args.out))  # each run's figures as it ends
    # measured again after the runs: the rate moves with the hour (and train.py runs in a process of its own)
    results["matmul_fp32_gflops_after"] = round(matmul_rate(torch.float32) / 1e9, 1)
    write(results, list(configs), Path(args.out))
    print((Path(args.out) / "results.md").read_text(), end="")


def write(results: dict, configs: list[str], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", results)
    lines = [f"{results['date']}, commit {results['commit']}, {results['machine']}, torch {results['torch']}, "
             f"{results['threads']} threads; "
             f"fp32 matrix products {results['matmul_fp32_gflops']:.0f} GFLOP/s before the runs"
             + (f", {after:.0f} after them" if (after := results.get("matmul_fp32_gflops_after")) else "")
             + " (run.py's process; the fraction is of the rate before).", "",
             "| run | words/s (src+tgt, the issue's unit, after the warm-up) | tokens/s (with each side's </s>) | s/step "
             "| peak RSS (MB) | loss at last step | test BLEU | decode test (s) | GFLOP/step | MFLOP/token | "
             "achieved GFLOP/s | of matmul rate |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in configs:
        r = results[name]
        per_token = r["gflops_per_step"] * 1e3 / (r["tokens_per_s"] * r["s_per_step"])  # a token: src or tgt, </s> too
        lines.append(f"| {name} ({r['steps']} steps, timed after {r['timed_after_step']}) | {r['words_per_s']:,.0f} | "
                     f"{r['tokens_per_s']:,.0f} | {r['s_per_step']:.3f} | "
                     f"{r['peak_rss_mb']:,.0f} | {r['loss_last']:.3f} | {r['test_bleu']:.2f} | {r['test_decode_s']:.2f} | "
                     f"{r['gflops_per_step']:.1f} | {per_token:.1f} | {r['achieved_gflops']:.1f} | "
                     f"{r['fraction_of_matmul_rate']:.1%} |")
    tokenized = [f"{name} {results[name]['tokenizing_peak_rss_mb']:,.0f} MB" for name in configs
                 if results[name].get("tokenizing_peak_rss_mb")]
    if tokenized:
        lines += ["", "Tokenized the corpus with spaCy in a child process, whose peak RSS (pages shared with the run "
                  f"counted in it too) is not in the table: {', '.join(tokenized)}."]
    write_text(out / "results.md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
