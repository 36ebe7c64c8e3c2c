"""Will it fit? Estimate a training step's peak memory before running it, on the CPU, in seconds:

    python plan.py [the overrides you would give train.py] [plan.gpu_gb=12]   # (a run's trainer.gpu_gb: that card)
    python plan.py -m memory=none,amp,accum,checkpoint,chunked_ce model=base    # strategies ranked by peak

One training step of the worst-case batch (every sentence as long as the longest the data settings allow) runs on
fake tensors that allocate nothing (src/planner.py); the peak is split into parameters, gradients, optimizer state,
activations, logits and backward temporaries, and checked against plan.gpu_gb with a margin for the CUDA allocator
(plan.overhead) and context (plan.context_gb). It plans for plan.device (cuda, where attention runs in fused
kernels that keep no attention weights; or cpu). Without plan.src_len/tgt_len/src_vocab/tgt_vocab the lengths and
vocabularies are measured on the training data as training prepares it (cached; no GPU needed). With
plan.world_size=N it plans one of N torchrun ranks: with DDP's gradient buckets, or with memory=fsdp its shards.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from hydra import compose, initialize_config_dir

from src.config_check import check_command_line, primary_config, sweep_with_preset
from src.errors import UserError, error_lines
from src.loggers import run_name

if TYPE_CHECKING:
    from src.planner import Estimate
# torch and the modules that import it (src.settings, src.memory, src.planner, src.planning) are imported where they
# are used: --help and a mistyped override are answered without them (as train.py answers)


def jobs(overrides: list[str], multirun: bool) -> list[list[str]]:
    """The jobs train.py -m would run, a preset's own sweep included."""
    return sweep_with_preset(overrides)[0] if multirun else [overrides]


def resolved(overrides: list[str], primary: tuple[Path, str]) -> dict:
    """The job's config, composed from ``primary`` (a folder and a config name: conf/train.yaml, or a run's saved
    ``.hydra/config.yaml``) and resolved as train.py resolves it."""
    from omegaconf import OmegaConf

    from src.data.corpus import SPLITS
    from src.planning import sizes_given
    from src.settings import resolve_config

    with initialize_config_dir(config_dir=str(primary[0]), version_base="1.3"):
        cfg = compose(config_name=primary[1], overrides=[*overrides, "paths.output_dir=."])
    if sizes_given(cfg.get("plan")):  # the data is not read: no files needed
        for split in SPLITS:
            if OmegaConf.is_missing(cfg.data, f"{split}_prefix"):
                cfg.data[f"{split}_prefix"] = None
    conf = resolve_config(cfg)  # else data=files without its paths: one line, as train.py says it
    if card := conf["trainer"].get("gpu_gb"):  # the card the run trains as on is the one to check
        conf.setdefault("plan", {})["gpu_gb"] = card
    return conf


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     usage="python plan.py [-m] [--config-dir DIR] [--config-path DIR "
                                           "--config-name NAME] [overrides ...]")
    parser.add_argument("-m", "--multirun", action="store_true", help="sweep the overrides' lists, one row each")
    parser.add_argument("-cd", "--config-dir", help="a folder laid out as conf/ with options of one's own, as "
                        "train.py's --config-dir (the same as hydra.searchpath=[file:///that/folder])")
    parser.add_argument("-cp", "--config-path", help="with --config-name: the primary config, as train.py's (a "
                        "run's saved config: --config-path <run>/.hydra --config-name config)")
    parser.add_argument("-cn", "--config-name")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    named = [*(["--config-path", args.config_path] if args.config_path else []),
             *(["--config-name", args.config_name] if args.config_name else [])]
    if args.config_dir:
        args.overrides.append(f"hydra.searchpath=[file://{Path(args.config_dir).expanduser().resolve()}]")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    rows, failed = [], []
    try:
        check_command_line([*named, *(["-m"] if args.multirun else []), *args.overrides])
        primary = tuple(primary_config(named)[1])
        from src.planning import context_gb, plan_config
        sweep = jobs(args.overrides, args.multirun)
        for job in sweep:
            try:
                conf = resolved(job, primary)
                strategy, est, info = plan_config(conf)
            except UserError as e:  # in a sweep, as train.py -m does, one job that cannot run leaves the others
                if len(sweep) == 1:
                    raise
                failed.append((job, e))
                continue
            rows.append((job, conf, strategy, est, info))
    except UserError as e:
        print(error_lines(e), file=sys.stderr)
        return 1
    if not rows:
        print_failed(failed, sweep)
        return 1
    if len(rows) == 1 and not failed:
        job, conf, strategy, est, _ = rows[0]
        gpu, overhead, context = conf["plan"]["gpu_gb"], conf["plan"]["overhead"], context_gb(conf["plan"])
        if strategy.auto:  # its choice is checked against the budget it was chosen for, not plan.gpu_gb
            gpu = strategy.budget_gb
        print_one(conf, strategy, est, rows[0][4], gpu, overhead, context)
        if est.required_gb(overhead, context) > gpu and not strategy.auto:
            sys.stdout.flush()  # the verdict now, piped too: the way to fit takes seconds more to estimate
            print_fix(job, gpu, context, est, primary)
    else:
        print_table(rows, sweep)
        print_failed(failed, sweep)
    return 0


def print_failed(failed: list, sweep: list[list[str]]) -> None:
    """The jobs of a sweep that cannot be planned, each named by what the sweep varies and with its error."""
    shared = set.intersection(*(set(job) for job in sweep))
    for job, e in failed:
        name = " ".join(o for o in job if o not in shared) or " ".join(job)
        print(f"error: {name}: not planned: " + "; ".join(str(e).splitlines()), file=sys.stderr)


DEVICE_NOTE = {"cuda": "for CUDA (plan.device: attention in fused kernels)",
               "cpu": "as on the CPU (plan.device: attention keeps its weights when it has dropout)"}


def device_note(info: dict) -> str:
    """How the plan attended: as on its device by default, else as trainer.attention runs there."""
    if "attention" not in info:
        return DEVICE_NOTE[info["device"]]
    setting = f"trainer.attention={info['attention']['setting']}"
    if info["device"] == "cpu":
        return f"as on the CPU (plan.device), attention in the kernels of {setting}"
    return (f"for CUDA (plan.device), attention as {setting} runs there: "
            + ("in math, which keeps its weights for backward" if info["attention"]["math"] else "in fused kernels"))


def print_one(conf, strategy, est, info, gpu, overhead, context) -> None:
    from src.memory import shown_categories
    from src.planner import cost_note

    s = est.shape
    print(f"model={conf['model']['name']} ({est.parameters / 1e6:.1f}M parameters, vocabularies "
          f"{info['src_vocab']:,}/{info['tgt_vocab']:,}), memory: {strategy.label}"
          + (f", one rank of {info['world_size']} (plan.world_size)" if "world_size" in info else ""))
    if strategy.trim_vocab and not {"src_vocab", "tgt_vocab"} & set(info["from_data"]):
        print("trim_vocab: not planned, as the vocabulary sizes are given (plan.src_vocab, plan.tgt_vocab): give the "
              "trimmed sizes, or leave them to the data, which trims them as training does")
    print(f"worst-case step: {s.accum_steps} micro-batch(es) of {s.pairs} pairs, {s.src_len} source and "
          f"{s.tgt_len} target positions each" + (f" (measured on the data: {', '.join(info['from_data'])})"
                                                  if info["from_data"] else ""))
    split = est.split_mb()
    for cat in shown_categories([split]):
        print(f"  {cat:<12} {split[cat]:>10,.1f} MiB")
    print(f"  {'peak':<12} {est.peak_mb:>10,.1f} MiB   (first micro-batch: forward {est.forward_delta / 2**20:+,.1f} "
          f"MiB, backward {est.backward_delta / 2**20:+,.1f} MiB)")
    if est.workspace:
        print(f"  {'+ cuBLAS':<12} {est.workspace / 2**20:>10,.1f} MiB   (workspaces, allocated beside the tensors)")
    print(f"  {'compute':<12} {est.flops / 1e9:>10,.1f} GFLOP   ({est.compute:.2f}x the model's FLOPs: what the step "
          "computes again counted)")
    need = est.required_gb(overhead, context)
    verdict = "fits" if need <= gpu else "does NOT fit"
    key = "memory.budget_gb" if strategy.auto else "trainer.gpu_gb" if conf["trainer"].get("gpu_gb") else "plan.gpu_gb"
    print(f"a GPU needs {need:.2f} GB (peak + cuBLAS + {overhead:.0%} allocator overhead + {context} GB CUDA context): "
          f"{verdict} a {gpu:g} GB card ({key})" if info["device"] == "cuda" else
          f"it needs {need:.2f} GB (peak + {overhead:.0%} allocator overhead): {verdict} {gpu:g} GB ({key})")
    if "tried" in info:
        print("memory=auto tried: " + ", ".join(f"{t['strategy']} x{t['accum_steps']} {t['estimate_mb']:,.0f} MiB"
                                                 for t in info["tried"])
              + (" (each with cuBLAS's workspaces)" if est.workspace else ""))
    print(f"estimated in {est.seconds:.1f} s on fake tensors, {device_note(info)}; expected cost: "
          f"{cost_note(strategy)}")


def print_fix(job: list[str], gpu: float, context: float, configured: Estimate, primary: tuple[Path, str]) -> None:
    """What memory=auto would choose to fit the card (src/planner.py ``choose_strategy``), starting from the
    estimate of the configured setting just printed."""
    from src.planning import plan_config

    if gpu <= context:
        print(f"to fit: nothing fits: plan.gpu_gb={gpu:g} is not more than the {context:g} GB of the CUDA context "
              "(plan.context_gb); give the card's memory in GB")
        return
    try:
        auto = resolved([*job, "memory.auto=true", f"memory.budget_gb={gpu:g}"], primary)
        strategy, est, _ = plan_config(auto, configured)
    except UserError as e:
        print(f"to fit: {e}")
        return
    print(f"to fit: memory=auto memory.budget_gb={gpu:g} would train with {strategy.label}, accum_steps "
          f"{strategy.accum_steps} (micro-batches of up to {est.shape.pairs} pairs): "
          f"{est.allocated_bytes / 2**20:,.1f} MiB" + (" with cuBLAS's workspaces" if est.workspace else "")
          + ", the same effective batch")


def print_table(rows, sweep: list[list[str]]) -> None:
    """One row per job, ranked by peak, numbered as ``train.py -m`` numbers the sweep's jobs. What the jobs share
    (the card, the margins, the worst-case lengths, the device planned for) is said once; where a sweep varies it,
    each row says its own."""
    from src.memory import shown_categories
    from src.planner import cost_note
    from src.planning import context_gb

    ranked = sorted(rows, key=lambda r: r[3].peak_bytes)
    # memory=auto's row is checked against the budget it was chosen for (memory.budget_gb), the others against the card
    plans = [{**r[1]["plan"], "gpu_gb": r[2].budget_gb} if r[2].auto else r[1]["plan"] for r in ranked]
    cards = {(p["gpu_gb"], p["overhead"], context_gb(p)) for p in plans}
    lengths = {(r[3].shape.src_len, r[3].shape.tgt_len) for r in ranked}
    devices = {r[4]["device"] for r in ranked}
    fits = f"fits {plans[0]['gpu_gb']:g} GB" if len(cards) == 1 else "fits plan.gpu_gb"
    cats = shown_categories(r[3].by_category for r in ranked)
    head = ["job", "run", "micro-batch", "peak (MiB)", *cats, "needs (GB)", fits, "compute", "expected cost"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    shared = set.intersection(*(set(r[0]) for r in rows))
    number = {id(job): i for i, job in enumerate(sweep)}  # by identity: two equal jobs (memory=amp,amp) are two numbers
    for row, plan in zip(ranked, plans, strict=True):
        job, _conf, strategy, est, _info = row
        name = run_name(strategy.label, [o for o in job if o not in shared])
        split = est.split_mb()
        need = est.required_gb(plan["overhead"], context_gb(plan))
        s = est.shape
        batch = f"{s.accum_steps} x {s.pairs} pairs" + (f" of {s.src_len}/{s.tgt_len} positions" if len(lengths) > 1 else "")
        verdict = "yes" if need <= plan["gpu_gb"] else "**no**"
        print("| " + " | ".join([
            str(number[id(job)]), name, batch, f"{est.peak_mb:,.0f}", *(f"{split[c]:,.0f}" for c in cats), f"{need:.2f}",
            verdict if len(cards) == 1 else f"{verdict} ({plan['gpu_gb']:g} GB)", f"{est.compute:.2f}x",
            cost_note(strategy)]) + " |")
    notes = []
    if len(lengths) == 1:
        notes.append("worst-case batch: {} source / {} target positions per pair".format(*lengths.pop()))
    if len(cards) == 1:
        _, overhead, context = cards.pop()
        notes.append(f"needs = (peak + cuBLAS workspaces) x {1 + overhead:.2f} + {context} GB CUDA context" if context
                     else f"needs = (peak + cuBLAS workspaces) x {1 + overhead:.2f} (no CUDA context counted)")
    else:
        notes.append("needs = (peak + cuBLAS workspaces) x (1 + plan.overhead) + plan.context_gb, each row's own")
    if workspaces := {r[3].workspace for r in ranked if r[3].workspace}:
        notes.append("cuBLAS workspaces " + " or ".join(f"{w / 2**20:g} MiB" for w in sorted(workspaces)))
    notes.append("compute = the step's FLOPs, recomputation counted, against the model's")
    planned_as = {device_note(r[4]) for r in ranked}
    notes.append(f"planned {planned_as.pop()}" if len(planned_as) == 1 else
                 "planned for each row's plan.device" + (" and trainer.attention" if len(devices) == 1 else ""))
    print("\n" + "; ".join(notes))


if __name__ == "__main__":
    sys.exit(main())
