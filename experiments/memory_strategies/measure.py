"""What each memory strategy saves and costs, measured on one fixed batch for model=base.

    python experiments/memory_strategies/measure.py [--root ../shared/data/multi30k] [--device cpu|cuda]

For each configuration: one optimizer step to create Adam's state, one tracked step whose peak tensor memory is
split into parameters, gradients, optimizer state, activations, logits and backward temporaries (src/memory.py),
and whose FLOPs are counted (src/flops.py ``FlopCount``, recomputation included) against the model's FLOPs of its
micro-batches (``compute``), and three untracked steps whose median time is reported. On CUDA the allocator's max
allocated and reserved are recorded too.
Writes results.json, results.md and memory.png next to this file (or into --out).

The batch: 128 pairs drawn with a fixed seed from Multi30k's training split (de->en, spaCy words, min_freq 2), so
their lengths are realistic. Rows marked "XLM-R-size vocabulary" use a 250,002-entry shared vocabulary (XLM-R's
size) on the first 32 of those pairs: the memory of a step depends on shapes, not on which ids are used. With
--xlmr, the same 32 pairs are also encoded by the real XLM-R tokenizer, with and without trim_vocab.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from src.data.batching import limit_lengths, micro_batches, pair_sizes, token_batch_indices  # noqa: E402
from src.data.corpus import load_multi30k  # noqa: E402
from src.data.encode import encode_corpus, trim_vocabulary  # noqa: E402
from src.errors import UserError  # noqa: E402
from src.fileio import atomic_path, write_json, write_text  # noqa: E402
from src.flops import FlopCount  # noqa: E402
from src.memory import (  # noqa: E402
    CATEGORIES,
    MemoryStrategy,
    free_earlier_runs,
    keep_freed_host_memory,
    shown_categories,
    tracked_step,
)
from src.model import ModelArgs, Transformer  # noqa: E402
from src.tokenizers import BOS, EOS, PAD  # noqa: E402
from src.trainer import Trainer, inverse_sqrt_schedule  # noqa: E402

XLMR_VOCAB = 250_002


def conf(path: str) -> dict:
    import yaml  # PyYAML: a dependency of hydra-core and of transformers, so present on GPU machines too

    return yaml.safe_load((ROOT / "conf" / path).read_text()) or {}


def strategy(*names: str) -> MemoryStrategy:
    """The strategy that ``memory=[names]`` gives, read from the files in conf/memory/."""
    settings: dict = {}
    for name in names:
        settings |= conf(f"memory/{name}.yaml")
    return MemoryStrategy(**settings)


SPACY_CONFIGS = ["none", "amp", "accum", "truncate", "tokens", "checkpoint", "chunked_ce", "amp+accum",
                 "amp+checkpoint", "accum+checkpoint", "amp+checkpoint+chunked_ce"]
XLMR_CONFIGS = ["none", "amp", "chunked_ce", "amp+chunked_ce", "amp+checkpoint+chunked_ce"]


def base_args() -> dict:
    return {k: v for k, v in conf("model/base.yaml").items() if k != "name"}


SPACY = {"name": "spacy", "min_freq": 2, "max_vocab": None, "lowercase": False, "models": {}}


def fixed_batch(corpus, n: int = 128, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(len(corpus.train), generator=g)[:n].tolist()


def measure(label, strategy: MemoryStrategy, vocab, src_vocab, tgt_vocab, shared, split, idx, device) -> dict:
    free_earlier_runs()  # the configurations before this one, in this process: their tensors and cached blocks
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    torch.manual_seed(0)
    args = ModelArgs(src_vocab=src_vocab, tgt_vocab=tgt_vocab, pad_id=PAD, share_vocab=shared, **base_args())
    model = Transformer(args).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=device.type in ("cuda", "cpu"))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, inverse_sqrt_schedule(4000))
    trainer = Trainer(model, opt, sched, strategy, device, PAD, 0.1, 1.0)
    if strategy.truncates:
        split, _ = limit_lengths(split, strategy.max_src_len, strategy.max_tgt_len)
    batches = micro_batches(split, idx, pair_sizes(split), strategy.accum_steps, PAD, BOS, EOS)
    real = sum(b.n_src_tokens + b.n_tgt_tokens for b in batches)
    padded = sum(b.n_padded for b in batches)

    trainer.step(batches)  # Adam's moments now exist, as in every later step
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    with FlopCount() as counted:  # the step's work, recomputation included (as plan.py counts it)
        tracker = tracked_step(trainer, batches, device.type)
    model_flops = sum(args.training_flops(len(b), b.src.size(1), b.tgt_out.size(1)) for b in batches)
    row = {
        "config": label,
        "vocabulary": vocab,
        "pairs": len(idx),
        "micro_batches": len(batches),
        "real_tokens": real,
        "padding_ratio": round(1 - real / padded, 3),
        "parameters": model.num_parameters(),
        "peak_mb": round(tracker.peak / 2**20, 1),
        **{f"{k}_mb": round(tracker.peak_by_category.get(k, 0) / 2**20, 1) for k in CATEGORIES},
        # against the model's FLOPs of the padded micro-batches: chunked_ce skips padding, checkpoint recomputes
        "compute": round(counted.total / model_flops, 3),
    }
    if device.type == "cuda":
        row["cuda_max_allocated_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        row["cuda_max_reserved_mb"] = round(torch.cuda.max_memory_reserved() / 2**20, 1)
        torch.cuda.synchronize()
    times = []
    for _ in range(3):  # the median of three untracked steps
        start = time.perf_counter()
        trainer.step(batches)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    row["step_s"] = round(sorted(times)[1], 3)
    row["step_s_min_max"] = [round(min(times), 3), round(max(times), 3)]
    row["tokens_per_s"] = round(real / row["step_s"])
    del model, opt, trainer
    return row


def categories(rows: list[dict]) -> tuple[str, ...]:
    """The memory categories the rows' table and plot show (one process: nothing ``gathered``)."""
    return shown_categories({k: r.get(f"{k}_mb") for k in CATEGORIES} for r in rows)


def write_table(rows: list[dict], path: Path, header: str) -> None:
    cols = ["config", "vocabulary", "pairs", "peak_mb", *[f"{k}_mb" for k in categories(rows)], "step_s", "tokens_per_s",
            "compute", "padding_ratio"]
    if any("cuda_max_allocated_mb" in r for r in rows):
        cols[4:4] = ["cuda_max_allocated_mb", "cuda_max_reserved_mb"]
    lines = [header, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    write_text(path, "\n".join(lines) + "\n")


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 6))
    names = [f"{r['config']}\n({r['vocabulary']})" for r in rows]
    bottom = [0.0] * len(rows)
    for cat in categories(rows):
        values = [r[f"{cat}_mb"] for r in rows]
        ax.bar(names, values, bottom=bottom, label=cat)
        bottom = [b + v for b, v in zip(bottom, values)]
    for i, r in enumerate(rows):
        ax.text(i, bottom[i], f"{r['step_s']:.1f}s", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("peak tensor memory (MiB), split at the peak")
    ax.set_title(title + " (labels: step time)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    plt.xticks(rotation=60, ha="right", fontsize=8)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", default=os.environ.get("MULTI30K_ROOT", str(ROOT.parent / "shared/data/multi30k")))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=str(Path(__file__).parent))
    p.add_argument("--only", nargs="*", help="run only these config labels")
    p.add_argument("--plot-only", action="store_true", help="redraw the plot from an earlier results file")
    p.add_argument("--xlmr", help="the real XLM-R tokenizer (hub name or save_pretrained directory): adds rows with "
                                  "its ids, and trim_vocab")
    args = p.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit(f"error: --device {args.device}: no CUDA device is visible here; measure on the CPU with --device cpu")
    device = torch.device(args.device)
    if device.type == "cpu":  # as a run does (trainer.reuse_host_memory, the default): without it, each step's
        keep_freed_host_memory()  # fresh pages cost time in proportion to the memory a strategy takes
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = "" if device.type == "cpu" else f"_{device.type}"
    if args.plot_only:
        rows = json.loads((out / f"results{suffix}.json").read_text())["rows"]
        plot(rows, out / f"memory{suffix}.png", f"model=base, one batch, {device.type}")
        return
    cache = Path(os.environ.get("MT_CACHE_DIR") or ROOT / ".cache")  # where train.py keeps it (paths.cache_dir)
    try:
        corpus = load_multi30k("de", "en", args.root, cache)
        encoded = encode_corpus(corpus, SPACY, cache)
        # the real XLM-R tokenizer: its ids, and trim_vocab
        full = encode_corpus(corpus, {"name": "xlmr", "name_or_path": args.xlmr}, cache) if args.xlmr else None
    except UserError as e:  # the corpus or the tokenizer: one line, naming the flag
        sys.exit(f"error: {e} (--root {args.root}" + (f", --xlmr {args.xlmr})" if args.xlmr else ")"))
    jobs = plan_jobs(corpus, encoded, full)

    def chosen_by(label: str) -> bool:  # "tokens" chooses "tokens (1958)", the row named by its budget
        return not args.only or any(chosen_by_name(label, name) for name in args.only)

    if unknown := [name for name in args.only or [] if not any(chosen_by_name(j[0], name) for j in jobs)]:
        sys.exit(f"error: --only {', '.join(unknown)}: no such row; the rows are {', '.join(j[0] for j in jobs)}")
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    header = (f"model=base, {device.type} ({machine}), torch {torch.__version__}, {time.strftime('%Y-%m-%d')}; "
              f"command: python experiments/memory_strategies/measure.py --device {device.type}")
    rows = []
    for label, vocab, chosen, split, batch_idx, src_v, tgt_v, shared in jobs:
        if not chosen_by(label):
            continue
        row = measure(label, chosen, vocab, src_v, tgt_v, shared, split, batch_idx, device)
        row["strategy"] = asdict(chosen)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "strategy"}), flush=True)
        # after each row: a run stopped at a time limit (a lent GPU's) keeps the rows it measured
        write_json(out / f"results{suffix}.json", {"header": header, "rows": rows})
        write_table(rows, out / f"results{suffix}.md", header)
    try:
        plot(rows, out / f"memory{suffix}.png", f"model=base, one batch, {device.type}")
    except ImportError:
        print("matplotlib not installed: no plot")


def plan_jobs(corpus, encoded, full) -> list[tuple]:
    """The rows to measure, each (label, vocabulary, strategy, split, pair indices, source vocabulary, target
    vocabulary, shared): spaCy's, XLM-R-sized ones, and the real XLM-R tokenizer's where ``full`` is its encoding."""
    train = encoded.splits["train"]
    idx = fixed_batch(corpus)
    sizes = pair_sizes(train)
    real_tgt = sum(len(train.tgt[i]) + 1 for i in idx)

    jobs = []
    for label in SPACY_CONFIGS:
        if label == "tokens":
            # a budget holding about as many target tokens as the fixed batch; its most padded batch
            budget = real_tgt
            candidates = token_batch_indices(sizes, budget, shuffle=True, seed=0)
            worst = max(candidates, key=lambda b: len(b) * max(sizes[i] for i in b))
            jobs.append((f"tokens ({budget})", "spacy", MemoryStrategy(max_tokens=budget), train, worst,
                         len(encoded.src_codec), len(encoded.tgt_codec), False))
        else:
            jobs.append((label, "spacy", strategy(*label.split("+")), train, idx,
                         len(encoded.src_codec), len(encoded.tgt_codec), False))
    for label in XLMR_CONFIGS:
        jobs.append((label, "xlmr-size", strategy(*label.split("+")), train, idx[:32], XLMR_VOCAB, XLMR_VOCAB, True))
    if full is not None:
        trimmed = trim_vocabulary(full)
        for label in ("none", "chunked_ce", "trim_vocab", "trim_vocab+chunked_ce"):
            enc = trimmed if "trim_vocab" in label else full
            v = len(enc.src_codec)
            jobs.append((label, "xlmr", strategy(*label.split("+")), enc.splits["train"], idx[:32], v, v, True))
    return jobs


def chosen_by_name(label: str, name: str) -> bool:
    return label == name or label.startswith(f"{name} (")


if __name__ == "__main__":
    main()
