"""What each speed choice of the trainer is worth on the reference workload: `python experiments/throughput/ablate.py`.

Times training steps of experiment=throughput_ref with the project's Trainer, once as train.py runs it and once
with each choice undone, on the same batches (epoch 0's order, seed 1234): --warmup steps untimed, then --steps
timed. A fresh model and optimizer per variant, so each starts from the same weights. Writes ablation.md and
ablation.json next to this file (or into --out). Needs the Multi30k files (MULTI30K_ROOT or --root).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE))

from run import ROOT, commit, reference  # noqa: E402
from src import trainer as trainer_module  # noqa: E402
from src.building import build_model, build_optimizer  # noqa: E402
from src.data.batching import batch_indices, epoch_batches, micro_batches, pair_sizes  # noqa: E402
from src.errors import UserError  # noqa: E402
from src.fileio import write_json, write_text  # noqa: E402
from src.memory import TensorMemoryTracker, keep_freed_host_memory  # noqa: E402
from src.trainer import Trainer  # noqa: E402

# name: (what is undone, settings). The first runs before keep_freed_host_memory (process-wide, for good);
# "as train.py runs it" is the trainer as train.py runs experiment=throughput_ref.
BASELINE = "as train.py runs it"
VARIANTS = {
    "glibc's default malloc": ("trainer.reuse_host_memory: freed memory kept for reuse, not unmapped",
                               {"malloc": "default"}),
    "as train.py runs it": ("", {}),
    "loss backward through autograd": ("the closed-form backward of the label-smoothed loss (src/trainer.py)",
                                       {"loss": "autograd"}),
    "sentence batches of 128, no length bucketing": (
        "token batches of 2,000 sorted by length (the plain loop's batching instead)", {"batching": "random128"}),
    "Adam foreach": ("fused Adam (one kernel for all parameters)", {"adam": "foreach"}),
    "Adam for-loop": ("fused Adam", {"adam": "loop"}),
    "zero_grad(set_to_none=False)": ("set_to_none: gradients freed, not zero-filled", {"set_to_none": False}),
    "1 thread": ("PyTorch's default threads (one per core)", {"threads": 1}),
    "tensor-memory tracking on": ("trainer.track_memory=false in the preset", {"track": True}),
}


def autograd_loss(logits, target, pad_id: int, epsilon: float):
    """label_smoothed_loss as it was before its closed-form backward: autograd through log_softmax, gather, mean."""
    lprobs = F.log_softmax(logits.float(), dim=-1)
    mask = target != pad_id
    nll = -lprobs.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    loss = (1.0 - epsilon) * nll - epsilon * lprobs.mean(dim=-1)
    return torch.where(mask, loss, 0.0).sum(), torch.where(mask, nll, 0.0).sum()


def batches_for(settings: dict, conf: dict, strategy, split, codec, n: int) -> list:
    sizes = pair_sizes(split)
    if settings.get("batching") == "random128":  # pool_batches=1: each batch is 128 random pairs
        order = batch_indices(sizes, 128, shuffle=True, seed=conf["seed"], epoch=0, pool_batches=1)
    else:
        order = epoch_batches(sizes, conf["data"]["batch_size"], strategy.max_tokens, True, conf["seed"], 0)
    return [micro_batches(split, idx, sizes, 1, codec.pad_id, codec.bos_id, codec.eos_id) for idx in order[:n]]


def time_variant(settings: dict, conf: dict, strategy, encoded, split, warmup: int, steps: int) -> dict:
    codec = encoded.tgt_codec
    batches = batches_for(settings, conf, strategy, split, codec, warmup + steps)
    threads = torch.get_num_threads()
    torch.set_num_threads(settings.get("threads", threads))
    torch.manual_seed(conf["seed"])
    model = build_model(conf["model"], encoded)
    optimizer, scheduler, _ = build_optimizer(model, conf["optim"], torch.device("cpu"))
    if "adam" in settings:  # the same optimizer without the fused kernel
        optimizer = torch.optim.Adam(model.parameters(), lr=optimizer.param_groups[0]["initial_lr"], betas=(0.9, 0.98),
                                     eps=1e-9, foreach=settings["adam"] == "foreach")
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, scheduler.lr_lambdas[0])
    if not settings.get("set_to_none", True):
        zero_grad = optimizer.zero_grad
        optimizer.zero_grad = lambda set_to_none=True: zero_grad(set_to_none=False)
    trainer = Trainer(model, optimizer, scheduler, strategy, torch.device("cpu"), codec.pad_id,
                      conf["optim"]["label_smoothing"], conf["optim"]["clip_grad_norm"])
    if len(batches) <= warmup:
        raise UserError(f"--warmup {warmup} --steps {steps}: the epoch makes {len(batches)} batches; time fewer")
    steps = len(batches) - warmup  # (fewer than asked where the epoch makes fewer batches)
    tokens = 0
    seconds = 0.0
    for i, mbs in enumerate(batches):
        tracker = TensorMemoryTracker("cpu") if settings.get("track") else None
        start = time.perf_counter()
        if tracker:
            tracker.watch(model)
            with tracker:
                stats = trainer.step(mbs)
            tracker.unwatch()
        else:
            stats = trainer.step(mbs)
        if i >= warmup:
            seconds += time.perf_counter() - start
            tokens += stats.n_src_tokens + stats.n_tgt_tokens
    torch.set_num_threads(threads)
    padded = sum(b.n_padded for mbs in batches for b in mbs)
    real = sum(b.n_src_tokens + b.n_tgt_tokens for mbs in batches for b in mbs)
    return {"steps": steps, "tokens_per_s": round(tokens / seconds, 1), "s_per_step": round(seconds / steps, 4),
            "padding_ratio": round(1 - real / padded, 3), "last_loss_per_token": round(
                stats.loss_sum.item() / stats.n_tgt_tokens, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default=os.environ.get("MULTI30K_ROOT") or str(ROOT.parent / "shared/data/multi30k"))
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--only", nargs="*", help="variant names (default: all)")
    parser.add_argument("--out", default=str(HERE))
    args = parser.parse_args()
    if unknown := [name for name in args.only or [] if name not in VARIANTS]:
        parser.error(f"--only {', '.join(unknown)}: no such variant; the variants are {', '.join(VARIANTS)}")
    if args.warmup < 0 or args.steps < 1:
        parser.error(f"--warmup {args.warmup} --steps {args.steps}: warmup must be >= 0 and steps >= 1")
    os.environ["MULTI30K_ROOT"] = args.root
    try:
        conf, strategy, encoded, split = reference([])
    except UserError as e:
        sys.exit(f"error: {e} (--root {args.root})")
    results = {"date": time.strftime("%Y-%m-%d"), "commit": commit(), "threads": torch.get_num_threads(),
               "torch": torch.__version__, "warmup": args.warmup, "steps": args.steps, "variants": {}}
    chosen = {*(args.only or VARIANTS), BASELINE}  # the trainer as it is, which every variant is compared to
    for name, (undone, settings) in VARIANTS.items():
        if settings.get("malloc") != "default":
            keep_freed_host_memory()  # as train.py does on the CPU (trainer.reuse_host_memory)
        if name not in chosen:
            continue
        autograd = settings.get("loss") == "autograd"
        with mock.patch.object(trainer_module, "label_smoothed_loss", autograd_loss) if autograd else nullcontext():
            try:
                r = time_variant(settings, conf, strategy, encoded, split, args.warmup, args.steps)
            except UserError as e:
                sys.exit(f"error: {e}")
        results["variants"][name] = {"undoes": undone, **r}
        print(name, r, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "ablation.json", results)
    base = results["variants"][BASELINE]["tokens_per_s"]
    lines = [f"{results['date']}, commit {results['commit']}, torch {results['torch']}, "
             f"{results['threads']} threads (default); "
             f"{results['variants'][BASELINE]['steps']} steps timed after {args.warmup} (fewer than --steps where "
             "the epoch makes fewer batches), the same batches for every variant.", "",
             "| variant | undoes | tokens/s | s/step | against the trainer | padding |", "|---|---|---|---|---|---|"]
    for name, r in results["variants"].items():
        lines.append(f"| {name} | {r['undoes'] or '-'} | {r['tokens_per_s']:,.0f} | {r['s_per_step']:.3f} | "
                     f"{r['tokens_per_s'] / base:.2f}x | {r['padding_ratio']:.1%} |")
    write_text(out / "ablation.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
