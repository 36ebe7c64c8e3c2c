"""An epoch's batches and the pairs trained over it, as a run holds them, at WMT14 en-de's 4.5M pairs (random pair
sizes): the time to make the pairs' sizes and target sizes and their resident memory, the time to make the epoch's
order, its resident memory, the time to take every step of the epoch
(``RankSteps``) marking the pairs trained (``Progress.trained``), and to turn those into a checkpoint's tensor.
Run in a checkout from before commit b5b74d5 (lists of Python ints) it measures that layout; before e1bc88a, the
sizes as lists.

    python experiments/foundation/batch_memory.py [--pairs 4500000]
"""

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from src.data import batching  # noqa: E402
from src.data.batching import epoch_batches  # noqa: E402
from src.data.encode import EncodedSplit, PackedSequences, seq_lengths  # noqa: E402
from src.distributed import World  # noqa: E402


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=4_500_000)
    n = parser.parse_args().pairs
    tensors = hasattr(batching, "EpochBatches")
    if tensors:
        from src.distributed import RankSteps
        from src.state import trained_mask
    else:
        from src.distributed import shard_steps as RankSteps  # noqa: N812
    g = torch.Generator().manual_seed(0)
    lengths = [torch.randint(4, 59, (n,), generator=g) + torch.randint(0, 40, (n,), generator=g) for _ in range(2)]
    # the ids are never read: torch.empty's pages are not resident until written
    split = EncodedSplit(*(PackedSequences(torch.empty(int(x.sum()), dtype=torch.int32), x) for x in lengths))
    gc.collect()
    base, started = rss_mib(), time.perf_counter()
    sizes = batching.pair_sizes(split)
    targets = (batching.target_sizes(split) if hasattr(batching, "target_sizes")
               else [k + 1 for k in seq_lengths(split.tgt)])
    print(f"the pairs' sizes and target sizes ({type(sizes).__name__}s): made in {time.perf_counter() - started:.2f} s, "
          f"RSS +{rss_mib() - base:.0f} MiB", flush=True)
    del split, lengths, targets
    for max_tokens, batch_size in ((None, 128), (8192, 0)):
        gc.collect()
        base = rss_mib()
        started = time.perf_counter()
        order = epoch_batches(sizes, batch_size, max_tokens, shuffle=True, seed=1, epoch=0)
        made, held = time.perf_counter(), rss_mib() - base
        trained = trained_mask([], n) if tensors else []
        steps = 0
        for _, _, group in RankSteps(order, World(rank=0, size=1)):
            if tensors:
                trained[[i for b in group for i in b]] = True
            else:
                trained += [i for b in group for i in b]
            steps += 1
        taken, end = time.perf_counter(), rss_mib() - base
        saved = (trained.nonzero().flatten().to(torch.int32) if tensors
                 else torch.tensor(trained, dtype=torch.int32))
        kept = time.perf_counter()
        print(f"{'tensor' if tensors else 'lists'}, " + (f"data.max_tokens={max_tokens}" if max_tokens else
              f"batches of {batch_size} pairs") + f": {len(order):,} batches made in {made - started:.2f} s, RSS "
              f"+{held:.0f} MiB; the epoch's {steps:,} steps taken in {taken - made:.2f} s, RSS at its end "
              f"+{end:.0f} MiB; the pairs trained as a checkpoint's tensor in {kept - taken:.2f} s", flush=True)
        del order, trained, saved


if __name__ == "__main__":
    main()
