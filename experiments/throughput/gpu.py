"""Everything this repository measures on a GPU, in one command (on one H200 about 6 minutes, then the compile run;
part 5's 12 GB card, added since, is not timed yet):

    MULTI30K_ROOT=/path/to/multi30k python experiments/throughput/gpu.py [--out DIR] [--steps 200]

1. the card's bf16 and fp32 matrix-multiply rates (8192 x 8192 products);
2. model=base (6+6, d_model 512, 8 heads, FFN 2048) on the throughput reference workload, trained by `train.py` at
   bf16 autocast (memory=amp) with batches of --max-tokens tokens: tokens/s and seconds per step after 20
   warm-up steps, peak CUDA memory (allocated and reserved), model FLOPs per step (as the run logs them:
   ModelArgs.training_flops of its own batches) and MFU, against the measured bf16 rate and against the card's
   datasheet peak where it is known;
   the same with other attention kernels than PyTorch's choice (trainer.attention: --attention, by default
   ATTENTION_CHOICES), and at fp32 for comparison: TF32 off (PyTorch's default), then on
   (trainer.matmul_precision=high, against the card's fp32 rate measured with TF32 on);
3. steps 11-13 of the bf16 run traced by torch.profiler (train.py debug=profile): profile_bf16_ops.txt, the
   operators by CUDA time; then the same with the first of --attention, in the same file;
4. the memory strategies on one batch of model=base (experiments/memory_strategies/measure.py --device cuda);
5. the memory planner against CUDA's allocator (experiments/planner/check.py --device cuda), the README's classic
   case included; then a 12 GB card on this one (experiments/planner/card.py: model=base, 512 Multi30k pairs a
   step, under trainer.gpu_gb=12, out of memory without back-off, trained with it and with memory=auto); then the
   host time of making a step's batch on this machine's CPU, now and as it was made until 2026-12-06
   (experiments/foundation/collate_time.py: seconds);
6. trainer.deterministic=true: two 20-step bf16 runs of one seed, whose losses must repeat to the bit;
7. the bf16 run of part 2 again with trainer.compile=true (torch.compile, dynamic shapes), last because compiling
   takes minutes: whether it pays on a GPU (it does not on the CPU).
They run in the order 1, 2 (bf16, then the attention kernels; --repeat N: N rounds of these, each starting one
later), 5, 2 (fp32), 3, 4, 6, 7: what a short device session must not lose first.

Writes results_gpu.md and results_gpu.json into --out (default: next to this file); parts 4 and 5 write their
own files into --out/memory_strategies and --out/planner. Needs torch, hydra-core and omegaconf, and the
Multi30k files; spaCy only if the encoded corpus is not already in the cache (MT_CACHE_DIR or .cache).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from run import BASE, TrainFailed, commit, run_train  # noqa: E402
from src.fileio import write_json, write_text  # noqa: E402
from src.flops import matmul_rate  # noqa: E402
from src.kernels import matmul_precision  # noqa: E402

# Dense (no sparsity) bf16 tensor-core peaks from the vendors' datasheets, TFLOP/s, by a name fragment.
DATASHEET_BF16_TFLOPS = {"H200": 989.4, "H100 SXM": 989.4, "H100 PCIe": 756.0, "H100 NVL": 835.6,
                         "H100": 989.4, "A100": 312.0,
                         "L40S": 362.1, "A10G": 70.0, "RTX 4090": 165.2, "RTX 3090": 71.0}


def datasheet_peak(name: str) -> float | None:
    return next((v * 1e12 for k, v in DATASHEET_BF16_TFLOPS.items() if k in name), None)


# trainer.attention's kernels timed besides PyTorch's choice (cuDNN's on an H200, torch 2.11): flash where it can
# (the decoder's causal self-attention) and memory-efficient attention where a padding mask is needed; efficient
# alone; flash and cuDNN. The first is profiled too.
ATTENTION_CHOICES = ("[flash,efficient]", "[efficient]", "[flash,cudnn]")
EVAL_PAIRS = 64  # validation and test pairs each run decodes (trainer.limit_eval): they are not timed
TAIL = 40  # lines of a failed part's output kept in results_gpu.json: the device returns only files under $OUT


def sub(script: str, *args: str) -> tuple[int, str]:
    """Runs a script of the repository, its output streamed; its exit status and the last TAIL lines of output."""
    cmd = [sys.executable, str(ROOT / script), *args]
    print("$", " ".join(cmd), flush=True)
    started = time.perf_counter()
    tail: collections.deque[str] = collections.deque(maxlen=TAIL)
    with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            print(line, end="", flush=True)
            tail.append(line.rstrip())
    print(f"({time.perf_counter() - started:.0f} s, exit {proc.returncode})", flush=True)
    return proc.returncode, "\n".join(tail)


def words(choice: str) -> str:
    """A trainer.attention setting in a file name: [flash,efficient] -> flash_efficient."""
    return "_".join(choice.strip("[]").split(","))


def last_error(output: str) -> str:
    """The line that says what went wrong: the last one, but not Hydra's hint after a train.py error."""
    lines = [line for line in output.splitlines() if line.strip() and "HYDRA_FULL_ERROR" not in line]
    return lines[-1] if lines else "no output"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default=os.environ.get("MULTI30K_ROOT") or str(ROOT.parent / "shared/data/multi30k"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps of each model=base run")
    parser.add_argument("--max-tokens", type=int, default=16384, help="token budget of a batch (padding counted)")
    parser.add_argument("--model", nargs="*", default=BASE, help="model overrides (default: model=base's sizes)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["attention", "fp32", "profile", "memory", "planner",
                                                                     "card", "host", "determinism", "compile"])
    parser.add_argument("--attention", nargs="+", default=list(ATTENTION_CHOICES),
                        help="trainer.attention settings timed besides PyTorch's choice; the first is profiled too")
    parser.add_argument("--repeat", type=int, default=1, help="rounds of the bf16 runs (PyTorch's choice and --attention)")
    parser.add_argument("--commit", help="the commit to record, where the tree's copy does not know its own (a device "
                        "tool's copy reported its session's first commit plus changes)")
    parser.add_argument("--out", default=str(HERE))
    args = parser.parse_args()
    os.environ["MULTI30K_ROOT"] = args.root
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit(f"error: --device {args.device}: no CUDA device is visible here; rehearse with --device cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    n = 8192 if cuda else 1024
    bf16_rate, fp32_rate = matmul_rate(torch.bfloat16, n, 20, device), matmul_rate(torch.float32, n, 20, device)
    peak = datasheet_peak(name) if cuda else None
    print(f"{name}: bf16 {bf16_rate / 1e12:.1f} TFLOP/s, fp32 {fp32_rate / 1e12:.1f} TFLOP/s (measured)", flush=True)
    results = {"date": time.strftime("%Y-%m-%d"), "commit": args.commit or commit(), "device": name,
               "torch": torch.__version__,
               "cuda": torch.version.cuda, "matmul_bf16_tflops": round(bf16_rate / 1e12, 1),
               "matmul_fp32_tflops": round(fp32_rate / 1e12, 1),
               "datasheet_bf16_tflops": peak and round(peak / 1e12, 1), "runs": {}, "failed": {}}
    write(results, out)  # the rates, whatever happens next

    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    common = [*args.model, f"trainer.device={device.type}", f"data.max_tokens={args.max_tokens}",
              f"trainer.max_steps={args.steps}", f"trainer.eval_every={args.steps}", "logger=none",
              f"trainer.limit_eval={EVAL_PAIRS}",  # BLEU is not what these runs measure: decode little
              *([f"trainer.peak_tflops={peak / 1e12:g}"] if peak else [])]  # the run's own MFU, as a user would see it

    def failed(part: str, error: str, output: str) -> None:
        """A part that failed: its error in the table, the end of its output in results_gpu.json."""
        results["failed"][part] = error
        results.setdefault("failed_output", {})[part] = output
        write(results, out)

    def ran(part: str, status: tuple[int, str]) -> None:
        if status[0]:
            failed(part, f"exit {status[0]}: {last_error(status[1])}", status[1])

    def train_run(label: str, extra: list[str], rate: float) -> None:
        overrides = [*common, *extra]
        run_dir = ROOT / "outputs" / "throughput_gpu" / stamp / label
        try:
            r = run_train(run_dir, overrides)  # with the model FLOPs of its timed steps, as the run logged them
        except TrainFailed as e:  # recorded, and the other parts still run: one device session has them all
            print(e, flush=True)
            failed(label, last_error(str(e)), "\n".join(str(e).splitlines()[-TAIL:]))
            return
        achieved = r["achieved_gflops"] * 1e9
        r |= {"achieved_tflops": round(achieved / 1e12, 1),
              "mfu_of_measured_matmul": round(achieved / rate, 3),
              "mfu_of_datasheet_bf16": peak and round(achieved / peak, 3)}
        summary = json.loads((run_dir / "summary.json").read_text())
        r["peak_memory_mb"], r["peak_reserved_mb"] = summary.get("peak_memory_mb"), summary.get("peak_reserved_mb")
        results["runs"][label] = r
        print(label, r, flush=True)
        write(results, out)

    # The bf16 run with PyTorch's choice of attention kernels, then with each of --attention; --repeat times in turn,
    # each round starting one later (the lent machine's host, which a bf16 step waits for, drifts in speed)
    choices = [None] + ([] if "attention" in args.skip else args.attention)
    for r in range(args.repeat):
        for choice in choices[r % len(choices):] + choices[:r % len(choices)]:
            label = "bf16" + (f"_attention_{words(choice)}" if choice else "") + (f"_{r + 1}" if args.repeat > 1 else "")
            train_run(label, ["memory=amp", *([f"trainer.attention={choice}"] if choice else [])], bf16_rate)
        if r == 0 and "planner" not in args.skip:  # early: seconds long, and what the planner's GPU check needs
            ran("planner", sub("experiments/planner/check.py", "--device", args.device, "--out", str(out / "planner")))
        if r == 0 and cuda and "card" not in args.skip:  # a 12 GB card on this one (the CPU has no cap to rehearse)
            ran("card", sub("experiments/planner/card.py", "--device", args.device, "--root", args.root,
                            "--out", str(out / "planner")))
        if r == 0 and "host" not in args.skip:  # seconds: the host time of a step's batch, which the device waits for
            status = sub("experiments/foundation/collate_time.py", "--root", args.root)
            ran("host", status)
            if not status[0]:
                results["batch_host_time"] = [line for line in status[1].splitlines() if line.startswith("|")]
                write(results, out)
    if "fp32" not in args.skip:
        train_run("fp32", [], fp32_rate)
        with matmul_precision("high"):
            tf32_rate = matmul_rate(torch.float32, n, 20, device)
        results["matmul_tf32_tflops"] = round(tf32_rate / 1e12, 1)
        train_run("fp32_tf32", ["trainer.matmul_precision=high"], tf32_rate)
    if "profile" not in args.skip:  # where a bf16 step's time goes: operators by CUDA time
        # one file for both profiles: the device tool returns at most 8 files, and all parts write 8 with it
        sections = []
        for choice, label in ((None, "profile_bf16"), (args.attention[0], "profile_bf16_" + words(args.attention[0]))):
            run_dir = ROOT / "outputs" / "throughput_gpu" / stamp / label
            ran(label, sub("train.py", "experiment=throughput_ref", "trainer.progress=false", f"hydra.run.dir={run_dir}",
                *args.model, f"trainer.device={device.type}", f"data.max_tokens={args.max_tokens}", "logger=none",
                "memory=amp", "debug=profile", f"trainer.limit_eval={EVAL_PAIRS}",
                *([f"trainer.attention={choice}"] if choice else [])))
            ops = run_dir / "profile" / "ops.txt"
            if ops.is_file():
                heading = f"trainer.attention={choice}" if choice else "trainer.attention=null (PyTorch's choice)"
                sections.append(f"# {heading}\n\n{ops.read_text()}")
                write_text(out / "profile_bf16_ops.txt", "\n\n".join(sections))
    if "memory" not in args.skip:
        ran("memory", sub("experiments/memory_strategies/measure.py", "--device", args.device, "--root", args.root,
            "--out", str(out / "memory_strategies")))
    if "determinism" not in args.skip:  # trainer.deterministic: does one seed give the same run twice?
        losses, exits = [], []
        for i in range(2):
            run_dir = ROOT / "outputs" / "throughput_gpu" / stamp / f"deterministic_{i}"
            status = sub("train.py", "experiment=throughput_ref", "trainer.progress=false", f"hydra.run.dir={run_dir}",
                *args.model, f"trainer.device={device.type}", f"data.max_tokens={args.max_tokens}", "logger=none",
                "memory=amp", "trainer.deterministic=true", "trainer.max_steps=20", "trainer.eval_every=20",
                "trainer.log_every=1", f"trainer.limit_eval={EVAL_PAIRS}")
            exits.append(status[0])
            ran(f"deterministic_{i}", status)
            metrics = run_dir / "metrics.jsonl"
            rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
            losses.append([r["loss"] for r in rows if "loss" in r])
        compared = exits == [0, 0] and losses[0] and len(losses[0]) == len(losses[1])  # else nothing to compare
        results["determinism"] = {"exit_codes": exits, "steps": [len(x) for x in losses],
                                  "losses_equal": bool(compared) and losses[0] == losses[1],
                                  "largest_difference": max((abs(a - b) for a, b in zip(*losses)), default=None)}
        print("determinism", results["determinism"], flush=True)
        write(results, out)
    if "compile" not in args.skip:  # last: compiling takes minutes, and the parts above matter more
        train_run("bf16+compile", ["memory=amp", "trainer.compile=true"], bf16_rate)
    if results["failed"]:
        sys.exit(f"error: {', '.join(results['failed'])} failed; {out / 'results_gpu.md'} says why")


def _mib(value: float | None) -> str:
    return "–" if value is None else f"{value:,.0f}"  # None: not measured (a CPU rehearsal), not 0


def write(results: dict, out: Path) -> None:
    write_json(out / "results_gpu.json", results)
    peak = results["datasheet_bf16_tflops"]
    tf32 = f" (TF32: {results['matmul_tf32_tflops']})" if "matmul_tf32_tflops" in results else ""
    lines = [f"{results['date']}, commit {results['commit']}, {results['device']}, torch {results['torch']} "
             f"(CUDA {results['cuda']}); measured "
             f"matrix products: bf16 {results['matmul_bf16_tflops']} TFLOP/s, fp32 {results['matmul_fp32_tflops']} "
             f"TFLOP/s{tf32}; datasheet dense bf16 peak: {peak or 'unknown'} TFLOP/s.", "",
             "| run | tokens/s (src+tgt, after 20 steps) | s/step | peak allocated (MiB) | peak reserved (MiB) | "
             "loss at last step | GFLOP/step | achieved TFLOP/s | of measured matmul rate | of datasheet bf16 peak |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for label, r in results["runs"].items():
        sheet = f"{r['mfu_of_datasheet_bf16']:.1%}" if r["mfu_of_datasheet_bf16"] else "-"
        lines.append(f"| {label} ({r['steps']} steps) | {r['tokens_per_s']:,.0f} | {r['s_per_step']:.4f} | "
                     f"{_mib(r['peak_memory_mb'])} | {_mib(r['peak_reserved_mb'])} | {r['loss_last']:.3f} | "
                     f"{r['gflops_per_step']:,.1f} | {r['achieved_tflops']:.1f} | "
                     f"{r['mfu_of_measured_matmul']:.1%} | {sheet} |")
    for label, error in results.get("failed", {}).items():
        lines.append(f"| {label} | failed: {error.replace('|', '/')} |" + " |" * 8)
    if table := results.get("batch_host_time"):
        lines += ["", "Host time of a step's batch (experiments/foundation/collate_time.py, this machine's CPU, 1 thread; "
                  "a bf16 step waits for it):", "", *table]
    if d := results.get("determinism"):
        if d.get("exit_codes", [0, 0]) != [0, 0] or not all(d["steps"]) or len(set(d["steps"])) > 1:
            lines += ["", f"trainer.deterministic=true, two bf16 runs of one seed: not compared (exit statuses "
                      f"{d.get('exit_codes')}, {d['steps']} logged steps; failed_output in results_gpu.json says why)."]
        else:
            lines += ["", f"trainer.deterministic=true, two bf16 runs of one seed ({d['steps']} logged steps): losses "
                      f"{'equal to the bit' if d['losses_equal'] else 'differ'} (largest difference "
                      f"{d['largest_difference']})."]
    write_text(out / "results_gpu.md", "\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
