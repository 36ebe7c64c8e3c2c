"""The memory planner against measured training steps.

    python experiments/planner/check.py                  # CPU: against the tensor tracker
    python experiments/planner/check.py --device cuda    # GPU: against CUDA's max_memory_allocated / reserved

For each configuration of src.planner.VALIDATION_CASES (tiny, small and base models; word and XLM-R-size
vocabularies; several strategies) and settings of trainer.attention (attention_cases), the planner's estimate on
fake tensors for that device next to a real step of the same batch; beside it, the plan for the other device
(cuda: attention in fused kernels; cpu: as the CPU runs it).
On CUDA also the README's classic case (src.planner.CLASSIC_CASES), too large for a CPU check; the tracker's peak
of the same step beside the allocator's (tensors only: the difference is what CUDA allocates besides tensors), and,
first, what the allocator keeps after a process's first matrix products (``workspace_probe``: cuBLAS's workspaces).
Writes results_<device>.md and results_<device>.json next to this file (or into --out). Needs torch only.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from src.errors import ConfigError  # noqa: E402
from src.fileio import write_json, write_text  # noqa: E402
from src.kernels import attention_backends  # noqa: E402
from src.memory import MemoryStrategy  # noqa: E402
from src.model import ModelArgs  # noqa: E402
from src.planner import CLASSIC_CASES, SMALL, VALIDATION_CASES, StepShape, estimate_step, measure_step  # noqa: E402

MiB = 2**20


def attention_cases(cuda: bool) -> list[tuple]:
    """trainer.attention's kernels (src/kernels.py), planned and measured, the setting last: math keeps the attention
    weights for backward (and dropout's mask), fused kernels do not. efficient is CUDA's only; the CPU's flash
    kernel runs without dropout only, which the model has."""
    return [(f"small spacy amp, 200 tokens, attention=[{name}]", SMALL, (8012, 6190, False), MemoryStrategy(amp="bf16"),
             StepShape(1, 200, 200), [name]) for name in (("math", "efficient") if cuda else ("math",))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=str(Path(__file__).parent))
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit(f"error: --device {args.device}: no CUDA device is visible here; check against the CPU with "
                 "--device cpu")
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    other = "cpu" if cuda else "cuda"
    rows = []
    probe = workspace_probe(device) if cuda else {}
    if probe:
        print("kept after the first products (MiB, cumulative):", probe, flush=True)
    cases = [(*case, None) for case in VALIDATION_CASES + (CLASSIC_CASES if cuda else [])] + attention_cases(cuda)
    for name, dims, vocab, strategy, shape, attention in cases:
        margs = ModelArgs(src_vocab=vocab[0], tgt_vocab=vocab[1], pad_id=1, share_vocab=vocab[2], **dims)
        est = estimate_step(margs, strategy, shape, device=device.type, attention=attention)
        t0 = time.perf_counter()
        if cuda:  # the cases measured before this one: the blocks the allocator kept for them (measure_step
            torch.cuda.empty_cache()  # collects their tensors first), so each case reserves its own
        with attention_backends(attention):
            real = measure_step(margs, strategy, shape, device)
        row = {"case": name, "shape": f"{shape.accum_steps} x {shape.pairs} pairs, {shape.src_len}/{shape.tgt_len}",
               "estimate_mb": round(est.allocated_bytes / MiB, 1), "measured_mb": round(real["peak"] / MiB, 1),
               "error_pct": round(100 * (est.allocated_bytes - real["peak"]) / real["peak"], 2),
               "planner_s": round(est.seconds, 2), "real_step_s": round(time.perf_counter() - t0, 2),
               f"planned_for_{other}_mb": planned_for(other, margs, strategy, shape, attention)}
        if "reserved" in real:
            row["reserved_mb"] = round(real["reserved"] / MiB, 1)
            row["tracked_mb"] = round(real["tracked"] / MiB, 1)
            row["workspace_mb"] = round(est.workspace / MiB, 1)
            row["estimate_split_mb"] = est.split_mb()
            row["tracked_split_mb"] = {k: round(v / MiB, 1) for k, v in real["tracked_by_category"].items()}
        rows.append(row)
        print(row, flush=True)
        write(rows, device, Path(args.out), probe)  # after each row: a run stopped at a time limit keeps what it measured
    print((Path(args.out) / f"results_{device.type}.md").read_text())


def planned_for(device: str, margs: ModelArgs, strategy: MemoryStrategy, shape: StepShape, attention) -> float | None:
    """The plan for the other device (MiB); None where it has none of the kernels of ``attention``."""
    try:
        return round(estimate_step(margs, strategy, shape, device=device, attention=attention).allocated_bytes / MiB, 1)
    except ConfigError:
        return None


def workspace_probe(device: torch.device) -> dict[str, float]:
    """What the allocator keeps after a fresh process's first matrix products, their outputs freed (MiB, cumulative):
    cuBLAS's and cuBLASLt's workspaces, kept per handle and stream, with handles per thread: the main thread's
    (forward, optimizer) and, from the first backward on, autograd's device thread's."""
    a, w, bias = (torch.randn(*size, device=device, requires_grad=True) for size in ((512, 512), (512, 512), (512,)))
    torch.cuda.synchronize(device)
    held = torch.cuda.memory_allocated(device)
    kept = {}
    steps = {"mm": lambda: a.detach() @ w.detach(),
             "linear with bias": lambda: torch.nn.functional.linear(a.detach(), w.detach(), bias.detach()),
             "linear, bf16 autocast": lambda: _autocast_linear(a, w, bias, device, backward=False),
             "backward": lambda: torch.nn.functional.linear(a, w, bias).sum().backward(),
             "backward, bf16 autocast": lambda: _autocast_linear(a, w, bias, device, backward=True)}
    for label, fn in steps.items():
        fn()
        a.grad = w.grad = bias.grad = None
        torch.cuda.synchronize(device)
        kept[label] = round((torch.cuda.memory_allocated(device) - held) / MiB, 3)
    return kept


def _autocast_linear(a, w, bias, device, backward: bool) -> None:
    with torch.autocast(device.type, torch.bfloat16):
        y = torch.nn.functional.linear(a, w, bias).float().sum()
    if backward:
        y.backward()


def _mib(value: float | None) -> str:
    return "–" if value is None else f"{value:,.1f}"  # None: no such plan (that device lacks the kernels)


def write(rows: list[dict], device: torch.device, out: Path, probe: dict | None = None) -> None:
    cuda = device.type == "cuda"
    other = "cpu" if cuda else "cuda"
    what = "CUDA max_memory_allocated" if cuda else "tracked peak of a real CPU step"
    machine = (torch.cuda.get_device_name(device) if cuda
               else f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads")
    lines = [f"Planner estimate (plan.device={device.type}) against the {what}; {machine}, torch "
             f"{torch.__version__}, {time.strftime('%Y-%m-%d')}. Beside: the plan for the other device "
             "(cuda: attention in fused kernels, no attention weights kept; cpu: as the CPU runs it).", "",
             "| case | batch (micro-batches x pairs, src/tgt positions) | estimate (MiB) | measured (MiB) | error | "
             + ("CUDA reserved (MiB) | tracked tensors (MiB) | planned cuBLAS workspaces (MiB) | " if cuda else "")
             + f"planned for {other} (MiB) | planner (s) |",
             "|---|---|---|---|---|---|" + ("---|---|---|" if cuda else "") + "---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['shape']} | {r['estimate_mb']:,.1f} | {r['measured_mb']:,.1f} | "
                     f"{r['error_pct']:+.2f}% | "
                     + (f"{r['reserved_mb']:,.1f} | {r['tracked_mb']:,.1f} | {r.get('workspace_mb', 0):,.1f} | " if cuda else "")
                     + f"{_mib(r[f'planned_for_{other}_mb'])} | {r['planner_s']:.2f} |")
    if probe:
        lines += ["", "Kept by the allocator after a fresh process's first products, outputs freed (MiB, cumulative): "
                  + "; ".join(f"{k} {v:g}" for k, v in probe.items()) + "."]
    differing = [(r["case"], k, v, r["tracked_split_mb"].get(k, 0.0)) for r in rows if "tracked_split_mb" in r
                 for k, v in r["estimate_split_mb"].items() if abs(v - r["tracked_split_mb"].get(k, 0.0)) >= 1]
    if differing:
        lines += ["", "Categories at the peak where the estimate and the tracked CUDA step differ by 1 MiB or more:", ""]
        lines += [f"- {case}: {k} {v:,.1f} planned, {t:,.1f} tracked" for case, k, v, t in differing]
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / f"results_{device.type}.md", "\n".join(lines) + "\n")
    write_json(out / f"results_{device.type}.json", {"rows": rows, "workspace_probe_mb": probe} if probe else rows)


if __name__ == "__main__":
    main()
