"""A smaller card on a larger GPU (trainer.gpu_gb): plan.py's verdict for that card, checked by training on it.

    MULTI30K_ROOT=/path/to/multi30k python experiments/planner/card.py [--gpu-gb 12] [--batch 512] [--out DIR]

model=base on Multi30k de->en, batches of --batch pairs (512: plan.py says 13.98 GB, more than a 12 GB card), one
epoch each (--steps to stop sooner), on the GPU capped at --gpu-gb as that card would be:

1. memory=none memory.oom_retries=0: out of memory, as on that card;
2. memory=none: the out-of-memory back-off redoes the step with twice the accumulation, and trains;
3. memory=auto memory.budget_gb=<gpu-gb>: the planner's choice, trained without running out;
4. memory=none on the whole card: what the step takes.

Beside each run, what plan.py says of its config for that card. Writes results_card.md and results_card.json into
--out (default: next to this file). ``--device cpu`` rehearses the script without a cap (the CPU has none), e.g.
with ``--model model=tiny --batch 64 --steps 3``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from src.fileio import write_json, write_text  # noqa: E402

RUNS = {  # label: (overrides, capped)
    "none, no back-off": (["memory=none", "memory.oom_retries=0"], True),
    "none, back-off": (["memory=none"], True),
    "auto": (["memory=auto", "memory.budget_gb={gpu_gb}"], True),
    "none, whole card": (["memory=none"], False),
}


@functools.cache  # the back-off's run and the whole card's are planned alike: once
def plan(overrides: tuple[str, ...], gpu_gb: float) -> str:
    """plan.py's verdict line for these overrides and a card of ``gpu_gb``."""
    proc = subprocess.run([sys.executable, "plan.py", *overrides, f"plan.gpu_gb={gpu_gb:g}"], cwd=ROOT,
                          capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if re.match(r"(a GPU needs|to fit:)", line)]
    return "; ".join(lines) or f"plan.py exit {proc.returncode}: {(proc.stdout + proc.stderr).strip()[-300:]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default=os.environ.get("MULTI30K_ROOT") or str(ROOT.parent / "shared/data/multi30k"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--gpu-gb", type=float, default=12.0, help="the card to train as on (trainer.gpu_gb)")
    parser.add_argument("--batch", type=int, default=512, help="sentence pairs per optimizer step")
    parser.add_argument("--steps", type=int, help="optimizer steps of each run (default: one epoch)")
    parser.add_argument("--model", nargs="*", default=["model=base"])
    parser.add_argument("--out", default=str(Path(__file__).parent))
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        sys.exit(f"error: --device {args.device}: no CUDA device is visible here; rehearse with --device cpu")
    os.environ["MULTI30K_ROOT"] = args.root
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    length = [f"trainer.max_steps={args.steps}", f"trainer.eval_every={args.steps}"] if args.steps else [
        "trainer.max_steps=null", "trainer.max_epochs=1"]
    common = [*args.model, "data=multi30k", f"data.batch_size={args.batch}", f"trainer.device={args.device}",
              "logger=none", "trainer.progress=false", "trainer.limit_eval=64", *length]
    results = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if cuda else "cpu",
               "torch": torch.__version__, "gpu_gb": args.gpu_gb, "common": common, "runs": {}}
    out = Path(args.out)
    for label, (extra, capped) in RUNS.items():
        overrides = [*common, *(o.format(gpu_gb=f"{args.gpu_gb:g}") for o in extra)]
        cap = [f"trainer.gpu_gb={args.gpu_gb:g}"] if capped and cuda else []
        run_dir = ROOT / "outputs" / "card" / stamp / label.replace(", ", "_").replace(" ", "_")
        started = time.perf_counter()
        proc = subprocess.run([sys.executable, "train.py", *overrides, *cap, f"hydra.run.dir={run_dir}"], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        summary_file = run_dir / "summary.json"
        s = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
        results["runs"][label] = {
            "command": " ".join(["python train.py", *overrides, *cap]), "exit": proc.returncode,
            "wall_s": round(time.perf_counter() - started, 1), "plan": plan(tuple(overrides), args.gpu_gb),
            **{k: s.get(k) for k in ("status", "error", "strategy", "steps", "oom_backoffs", "final_accum_steps",
                                     "peak_memory_mb", "peak_reserved_mb", "tokens_per_s", "gpu_gb", "auto")},
            "output_tail": proc.stdout.splitlines()[-5:],
        }
        print(label, {k: v for k, v in results["runs"][label].items() if k != "output_tail"}, flush=True)
        write(results, out)


def write(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results_card.json", results)
    lines = [f"{results['date']}, {results['device']}, torch {results['torch']}: training as on a "
             f"{results['gpu_gb']:g} GB card (trainer.gpu_gb), `{' '.join(results['common'])}`.", "",
             "| run | status | steps | out-of-memory back-offs | accum_steps at the end | peak allocated (MiB) | "
             "peak reserved (MiB) | tokens/s | plan.py for the card |", "|---|---|---|---|---|---|---|---|---|"]
    for label, r in results["runs"].items():
        status = r["status"] if r["status"] != "oom" else f"oom: {(r['error'] or '')[:160]}"
        lines.append(f"| {label} | {status} | {r['steps']} | {len(r['oom_backoffs'] or [])} | {r['final_accum_steps']} | "
                     f"{r['peak_memory_mb']} | {r['peak_reserved_mb']} | {r['tokens_per_s']} | {r['plan']} |")
    write_text(out / "results_card.md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
