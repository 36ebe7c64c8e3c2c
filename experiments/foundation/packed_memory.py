"""Resident memory of one side of an encoded corpus as a run holds it (PackedSequences: int32 ids as cached, each
sentence's length and start in arrays), against the layout before (ids widened to int64, lengths and starts in
Python lists). Random ids; the default is WMT14 en-de's 4.5M pairs at 30 pieces a sentence.

    python experiments/foundation/packed_memory.py [--pairs 4500000] [--length 30]
"""

import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from src.data.encode import PackedSequences  # noqa: E402


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def held_mib(make) -> float:
    """RSS added while what ``make()`` returns is alive, the cached int32 ids (held by the caller) not counted."""
    gc.collect()
    before = rss_mib()
    held = make()
    gc.collect()
    after = rss_mib()
    del held
    gc.collect()
    return after - before


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--pairs", type=int, default=4_500_000)
    p.add_argument("--length", type=int, default=30)
    args = p.parse_args()
    lengths = torch.full((args.pairs,), args.length, dtype=torch.int64)
    ids = torch.randint(0, 32_000, (args.pairs * args.length,), dtype=torch.int32)  # as the cache file holds them
    cached = ids.numel() * 4 / 2**20

    def before():  # 47f0fc5 and earlier: the loaded int32 ids were let go once widened
        return ids.long(), lengths.tolist(), (torch.cumsum(lengths, 0) - lengths).tolist()

    print(f"one side, {args.pairs:,} sentences of {args.length} ids")
    old = held_mib(before)
    print(f"before (int64 ids, lengths and starts in Python lists): {old:.0f} MiB")
    new = cached + held_mib(lambda: PackedSequences(ids, lengths))
    print(f"now (PackedSequences: int32 ids, lengths and starts in arrays): {new:.0f} MiB ({cached:.0f} MiB of ids)")
