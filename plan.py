"""Will it fit? Estimate a training step's peak memory before running it, on the CPU, in seconds:

    python plan.py [the overrides you would give train.py] [plan.gpu_gb=12]
    python plan.py -m memory=none,amp,accum,checkpoint,chunked_ce model=base    # strategies ranked by peak

One training step of the worst-case batch (every sentence as long as the longest the data settings allow) runs on
fake tensors that allocate nothing (src/planner.py); the peak is split into parameters, gradients, optimizer state,
activations, logits and backward temporaries, and checked against plan.gpu_gb with a margin for the CUDA allocator
(plan.overhead) and context (plan.context_gb). It plans for plan.device (cuda, where attention runs in fused
kernels that keep no attention weights; or cpu). Without plan.src_len/tgt_len/src_vocab/tgt_vocab the lengths and
vocabularies are measured on the training data as training prepares it (cached; no GPU needed). With
plan.world_size=N it plans one of N torchrun ranks: with DDP's gradient buckets, or with memory=fsdp its shards.
"""

import argparse
import logging
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from src.config_check import check_command_line
from src.errors import UserError
from src.memory import CATEGORIES
from src.planner import cost_note
from src.run import plan_config

CONF = Path(__file__).resolve().parent / "conf"


def jobs(overrides: list[str], multirun: bool) -> list[list[str]]:
    if not multirun:
        return [overrides]
    return BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(overrides), None)[0]


def resolved(overrides: list[str]) -> dict:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[*overrides, "paths.output_dir=."])
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], usage="python plan.py [-m] [overrides ...]")
    parser.add_argument("-m", "--multirun", action="store_true", help="sweep the overrides' lists, one row each")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    rows = []
    try:
        check_command_line(["-m", *args.overrides] if args.multirun else args.overrides)
        for job in jobs(args.overrides, args.multirun):
            conf = resolved(job)
            strategy, est, info = plan_config(conf)
            rows.append((job, conf, strategy, est, info))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    plan = rows[0][1]["plan"]
    gpu, overhead, context = plan["gpu_gb"], plan["overhead"], plan["context_gb"]
    if len(rows) == 1:
        print_one(*rows[0], gpu, overhead, context)
        job, _, strategy, est, _ = rows[0]
        if est.required_gb(overhead, context) > gpu and not strategy.auto:
            print_fix(job, gpu, est)
    else:
        print_table(rows, gpu, overhead, context)
    return 0


DEVICE_NOTE = {"cuda": "for CUDA (plan.device: attention in fused kernels)",
               "cpu": "as on the CPU (plan.device: attention keeps its weights when it has dropout)"}


def print_one(job, conf, strategy, est, info, gpu, overhead, context) -> None:
    s = est.shape
    print(f"model={conf['model']['name']} ({est.parameters / 1e6:.1f}M parameters, vocabularies "
          f"{info['src_vocab']:,}/{info['tgt_vocab']:,}), memory: {strategy.label}"
          + (f", one rank of {info['world_size']} (plan.world_size)" if "world_size" in info else ""))
    print(f"worst-case step: {s.accum_steps} micro-batch(es) of {s.pairs} pairs, {s.src_len} source and "
          f"{s.tgt_len} target positions each" + (f" (measured on the data: {', '.join(info['from_data'])})"
                                                  if info["from_data"] else ""))
    split = est.split_mb()
    for cat in CATEGORIES:
        print(f"  {cat:<12} {split[cat]:>10,.1f} MiB")
    print(f"  {'peak':<12} {est.peak_mb:>10,.1f} MiB   (first micro-batch: forward {est.forward_delta / 2**20:+,.1f} "
          f"MiB, backward {est.backward_delta / 2**20:+,.1f} MiB)")
    need = est.required_gb(overhead, context)
    verdict = "fits" if need <= gpu else "does NOT fit"
    print(f"a GPU needs {need:.2f} GB (peak + {overhead:.0%} allocator overhead + {context} GB CUDA context): "
          f"{verdict} a {gpu:g} GB card (plan.gpu_gb)")
    if "tried" in info:
        print("memory=auto tried: " + ", ".join(f"{t['strategy']} x{t['accum_steps']} {t['estimate_mb']:,.0f} MiB"
                                                 for t in info["tried"]))
    print(f"estimated in {est.seconds:.1f} s on fake tensors, {DEVICE_NOTE[info['device']]}; expected cost: "
          f"{cost_note(strategy)}")


def print_fix(job: list[str], gpu: float, configured) -> None:
    """What memory=auto would choose to fit the card (src/planner.py ``choose_strategy``), starting from the
    estimate of the configured setting just printed."""
    try:
        strategy, est, _ = plan_config(resolved([*job, "memory.auto=true", f"memory.budget_gb={gpu:g}"]), configured)
    except UserError as e:
        print(f"to fit: {e}")
        return
    print(f"to fit: memory=auto memory.budget_gb={gpu:g} would train with {strategy.label}, accum_steps "
          f"{strategy.accum_steps} (micro-batches of up to {est.shape.pairs} pairs): {est.peak_mb:,.1f} MiB, the "
          "same effective batch")


def print_table(rows, gpu, overhead, context) -> None:
    ranked = sorted(rows, key=lambda r: r[3].peak_bytes)
    head = ["run", "micro-batch", "peak (MiB)", *CATEGORIES, "needs (GB)", f"fits {gpu:g} GB", "expected cost"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    shared = set.intersection(*(set(r[0]) for r in rows))
    for job, _conf, strategy, est, _info in ranked:
        varying = " ".join(o for o in job if o not in shared and not o.startswith("memory"))
        name = f"{strategy.label} {varying}".strip()
        split = est.split_mb()
        need = est.required_gb(overhead, context)
        s = est.shape
        print("| " + " | ".join([
            name, f"{s.accum_steps} x {s.pairs} pairs", f"{est.peak_mb:,.0f}", *(f"{split[c]:,.0f}" for c in CATEGORIES),
            f"{need:.2f}", "yes" if need <= gpu else "**no**", cost_note(strategy)]) + " |")
    first = ranked[0][3].shape
    print(f"\nworst-case batch: {first.src_len} source / {first.tgt_len} target positions per pair; "
          f"needs = peak x {1 + overhead:.2f} + {context} GB CUDA context; planned "
          f"{DEVICE_NOTE[ranked[0][4]['device']]}")


if __name__ == "__main__":
    sys.exit(main())
