"""Measured matrix-multiply rate of this machine in fp32 and bf16 (GFLOP/s), to read CPU timings of `amp` against.

    python experiments/foundation/matmul_rate.py [--size 2048] [--repeats 10]
"""

import argparse
import time

import torch


def rate(dtype: torch.dtype, n: int, repeats: int) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    seconds = time.perf_counter() - start
    return 2 * n**3 * repeats / seconds / 1e9


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--size", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.size}x{args.size} matrices")
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        print(f"{name}: {rate(dtype, args.size, args.repeats):.0f} GFLOP/s")
