"""The machine's measured matrix-multiply rate (``matmul_rate``): what the experiments compare achieved training
FLOP/s with (a run's ``model_tflops``, counted by ``ModelArgs.training_flops``) on a machine without a datasheet
peak; a run computes ``mfu`` only against ``trainer.peak_tflops``. And ``FlopCount``, the FLOPs an operator-level
count finds in a step (the planner's compute line)."""

from __future__ import annotations

import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count, shape_wrapper


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


class FlopCount(TorchDispatchMode):
    """The FLOPs of the matrix products run under it, ``total``, by PyTorch's formulas (``FlopCounterMode``'s: 2
    per multiply-add), the CPU's fused attention kernel counted as CUDA's is: forward, and backward with the scores
    it computes again. It counts the work a step does, recomputation included (memory=checkpoint's forward again,
    chunked_ce's output projection again), where ``ModelArgs.training_flops`` counts the model's, each product once.
    ``FlopCounterMode`` itself also tracks modules, with hooks under which memory=checkpoint keeps what it would
    not (a planned model=small step: 546 MiB against 274), so the planner, which counts memory in the same step,
    counts FLOPs with this."""

    def __init__(self):
        super().__init__()
        self.total = 0
        aten = torch.ops.aten
        self.formulas = {
            **flop_registry,
            aten._scaled_dot_product_flash_attention_for_cpu: shape_wrapper(_cpu_attention),
            aten._scaled_dot_product_flash_attention_for_cpu_backward: shape_wrapper(_cpu_attention_backward),
        }

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if (formula := self.formulas.get(getattr(func, "_overloadpacket", None))) is not None:
            self.total += formula(*args, **kwargs, out_val=out)
        return out


def _cpu_attention(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)


def _cpu_attention_backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)
