"""Host time to make a step's padded batch from Multi30k's encoded training pairs, at the reference workload's token
budget (2,000) and the GPU script's (16,384): ``micro_batches`` as a run calls it, against the way it made the batch
until 2026-12-06 (a view of each sentence, a ``torch.cat`` per sentence and side, then ``pad_sequence``), whose
tensors it must equal. On a GPU this time is on the step's critical path: the step waits for the device once (its
non-finite check), and only then makes the next batch.

    MULTI30K_ROOT=/path/to/multi30k python experiments/foundation/collate_time.py [--batches 60]

Reads the encoded corpus from the cache a run keeps (MT_CACHE_DIR or .cache); tokenizes it there first if missing.
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from src.data.batching import micro_batches, pair_sizes, split_batch, token_batch_indices  # noqa: E402
from src.data.corpus import load_multi30k  # noqa: E402
from src.data.encode import encode_corpus  # noqa: E402
from src.tokenizers import BOS, EOS, PAD  # noqa: E402

SPACY = {"name": "spacy", "min_freq": 2, "max_vocab": None, "lowercase": False, "models": {}}


def micro_batches_before(split, indices, sizes, parts, pad_id, bos_id, eos_id):
    """``micro_batches`` until 2026-12-06: each micro-batch's three padded tensors."""
    eos, bos = torch.tensor([eos_id]), torch.tensor([bos_id])
    out = []
    for part in split_batch(indices, sizes, parts):
        src, tgt = [split.src[i] for i in part], [split.tgt[i] for i in part]
        sides = [torch.cat([s, eos]) for s in src], [torch.cat([bos, t]) for t in tgt], [torch.cat([t, eos]) for t in tgt]
        out.append([torch.nn.utils.rnn.pad_sequence(x, batch_first=True, padding_value=pad_id) for x in sides])
    return out


def ms(fn, repeat: int = 5) -> float:
    """The fastest of ``repeat`` calls, in milliseconds."""
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=os.environ.get("MULTI30K_ROOT") or str(ROOT.parent / "shared/data/multi30k"))
    parser.add_argument("--batches", type=int, default=60, help="batches timed at each budget (the epoch's first)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the host work of the training loop's thread
    cache = Path(os.environ.get("MT_CACHE_DIR") or ROOT / ".cache")
    train = encode_corpus(load_multi30k("de", "en", args.root, cache), SPACY, cache).splits["train"]
    sizes = pair_sizes(train)
    print(f"torch {torch.__version__}, 1 thread; medians over the epoch's first {args.batches} batches of each budget "
          "(each batch's fastest of 5 calls)\n")
    print("| token budget | pairs a batch | ids a batch (src+tgt, special tokens included) | micro_batches (ms) "
          "| until 2026-12-06 (ms) | before / now |")
    print("|---|---|---|---|---|---|")
    for budget in (2000, 16384):
        rows = []
        for idx in token_batch_indices(sizes, budget, shuffle=True, seed=0)[:args.batches]:
            now, = micro_batches(train, idx, sizes, 1, PAD, BOS, EOS)
            before, = micro_batches_before(train, idx, sizes, 1, PAD, BOS, EOS)
            assert all(torch.equal(a, b) for a, b in zip((now.src, now.tgt_in, now.tgt_out), before, strict=True))
            rows.append((len(idx), now.n_src_tokens + now.n_tgt_tokens,
                         ms(lambda: micro_batches(train, idx, sizes, 1, PAD, BOS, EOS)),  # noqa: B023
                         ms(lambda: micro_batches_before(train, idx, sizes, 1, PAD, BOS, EOS))))  # noqa: B023
        pairs, ids, now_ms, before_ms = (statistics.median(column) for column in zip(*rows))
        print(f"| {budget:,} | {pairs:,.0f} | {ids:,.0f} | {now_ms:.2f} | {before_ms:.2f} | {before_ms / now_ms:.1f}x |")


if __name__ == "__main__":
    main()
