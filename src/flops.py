"""Counting the work: the machine's measured matrix-multiply rate, and the FLOPs of a training step as PyTorch's
``FlopCounterMode`` counts them (matrix products and attention, forward and backward), for model FLOP utilization:
achieved training FLOP/s as a fraction of what this machine's matrix products reach."""

from __future__ import annotations

import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from .data.batching import Batch
from .trainer import batch_loss


def matmul_rate(dtype: torch.dtype = torch.float32, n: int = 2048, repeats: int = 10,
                device: str | torch.device = "cpu") -> float:
    """FLOP/s of ``n x n`` matrix products in ``dtype`` on ``device`` (median-free: the mean of ``repeats``)."""
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


def step_flops(model: torch.nn.Module, batches: list[Batch], pad_id: int, label_smoothing: float = 0.1,
               loss_chunk: int | None = None) -> tuple[int, int]:
    """(FLOPs of forward and backward over ``batches``, source and target positions computed on, padding
    included). The optimizer's elementwise work is not counted, as model FLOPs conventionally are not."""
    positions = sum(b.n_padded for b in batches)
    with FlopCounterMode(display=False) as counter:
        for b in batches:
            loss, _ = batch_loss(model, b, pad_id, label_smoothing, loss_chunk)
            loss.backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops(), positions
