"""Measured matrix-multiply rate of this machine in fp32 and bf16 (GFLOP/s), to read CPU timings of `amp` against.

    python experiments/foundation/matmul_rate.py [--size 2048] [--repeats 10]
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from src.flops import matmul_rate  # noqa: E402


def rate(dtype: torch.dtype, n: int, repeats: int) -> float:
    return matmul_rate(dtype, n, repeats) / 1e9


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--size", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    if args.size < 1 or args.repeats < 1:
        p.error(f"--size {args.size} --repeats {args.repeats}: both must be >= 1")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.size}x{args.size} matrices")
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        print(f"{name}: {rate(dtype, args.size, args.repeats):.0f} GFLOP/s")
