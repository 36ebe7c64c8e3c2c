"""The machine's measured matrix-multiply rate: what achieved training FLOP/s (a run's ``model_tflops``, counted by
``ModelArgs.training_flops``) is compared with, for model FLOP utilization on a machine without a datasheet peak."""

from __future__ import annotations

import time

import torch


def matmul_rate(dtype: torch.dtype = torch.float32, n: int = 2048, repeats: int = 10,
                device: str | torch.device = "cpu") -> float:
    """FLOP/s of ``n x n`` matrix products in ``dtype`` on ``device`` (median-free: the mean of ``repeats``)."""
    if n < 1 or repeats < 1:
        raise ValueError(f"matmul_rate: n={n} and repeats={repeats} must be >= 1")
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    a @ b  # warm-up
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return 2 * n**3 * repeats / (time.perf_counter() - start)
