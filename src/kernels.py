"""trainer.attention: which of PyTorch's scaled-dot-product-attention kernels the run's attention may use.

Left at null, PyTorch picks for each call; on an H200 (torch 2.11) it picked cuDNN's attention. A list names the
kernels allowed, in order of preference (``torch.nn.attention.sdpa_kernel`` with ``set_priority``):
``[flash, efficient]`` runs flash attention where it can (the decoder's causal self-attention; it takes no padding
mask) and memory-efficient attention elsewhere; on the H200 that was 8-9% faster than PyTorch's choice for
model=base at bf16, about as much as one setting varied from run to run there (experiments/throughput). The order
is CUDA's: the CPU, which has flash and math only, runs flash wherever the list allows it and flash takes the call
(no attention dropout).
``check_attention`` refuses, at the start and naming the key, a list that runs none of the model's attention calls
on the run's device, precision and dropout; ``planned_attention`` tells the planner what the chosen kernels keep.
trainer.deterministic (``deterministic_algorithms``), PyTorch's deterministic kernels, is set here too: it decides
whether cuDNN's attention runs, and cuBLAS's workspace. So is trainer.matmul_precision (``matmul_precision``), the
arithmetic inside fp32 matrix products.
"""

from __future__ import annotations

import contextlib
import os
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .errors import ConfigError
from .model import ModelArgs, inner_dropouts

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
CPU_KERNELS = ("flash", "math")  # flash only without dropout


def shown(value) -> str:
    return f"[{','.join(map(str, value))}]" if isinstance(value, (list, tuple)) else str(value)


def attention_names(value) -> list[str] | None:
    """trainer.attention as a list of kernel names (one name alone is a list of one); null: PyTorch's choice."""
    if value is None:
        return None
    names = [value] if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else [value]
    unknown = [n for n in names if not isinstance(n, str) or n not in BACKENDS]
    if not names or unknown or len(set(names)) < len(names):
        why = f"unknown {', '.join(map(str, unknown))}" if unknown else "empty" if not names else "a kernel named twice"
        raise ConfigError(f"trainer.attention={shown(value)}: {why}; expected a list of {', '.join(BACKENDS)} in order of "
                          "preference (e.g. [flash,efficient]), or null for PyTorch's choice")
    return names


def attention_backends(value):
    """The run's attention kernels (trainer.attention) as a context, restored afterwards: a sweep's jobs share
    the process."""
    names = attention_names(value)
    return attention_kernels(None if names is None else [BACKENDS[n] for n in names])


# The kernels PyTorch tries on CUDA where trainer.attention is null, in its order on an H100 or H200 (sm90: the H200
# ran cuDNN's for every call of model=base at bf16 without attention dropout)
CUDA_DEFAULT = ("cudnn", "flash", "efficient", "math")


def cuda_kernel(names: list[str] | None, masked: bool, half: bool, dropout: float, head_dim: int,
                deterministic: bool) -> str:
    """The kernel CUDA trains one of the model's attention calls with: the first of ``names`` that takes it, by
    PyTorch 2.13's conditions (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp) as far as this model's calls
    meet them. Flash: half precision, no padding mask, head size at most 256 and a multiple of 8. cuDNN: half
    precision, a dropout that is a multiple of 1/16 (0.1 is not), no deterministic algorithms, head size at most
    128 and a multiple of 8. Memory-efficient: a head size that is a multiple of 8 in half precision, 4 in fp32.
    Math: any call. (GPU generations and cuDNN versions add limits of their own: ``check_attention`` on the GPU
    itself is the word on what runs.)"""
    def takes(name: str) -> bool:
        if name == "flash":
            return half and not masked and head_dim <= 256 and head_dim % 8 == 0
        if name == "cudnn":
            return half and (dropout * 16).is_integer() and not deterministic and head_dim <= 128 and head_dim % 8 == 0
        if name == "efficient":
            return head_dim % (8 if half else 4) == 0
        return True

    return next((n for n in names or CUDA_DEFAULT if takes(n)), "math")


def planned_attention(value, device: str, args: ModelArgs, half: bool) -> list[SDPBackend] | None:
    """The CPU kernels the planner's fake step (src/planner.py) attends with, to keep for backward what the
    run's kernels on ``device`` keep for the model of ``args``, at half precision (autocast) or fp32. CUDA's fused
    kernels (flash, efficient, cuDNN) keep their inputs, output and log-sum-exp, as the CPU's flash kernel does (run
    without dropout: CUDA's draw it again in backward); math keeps the attention weights and dropout's mask, as it
    does on the CPU (where that mask is a float per weight, on CUDA a byte: the plan is 3 bytes a weight over). On
    CUDA a call runs the first kernel of the list that takes it (``cuda_kernel``; deterministic algorithms as they
    are set, as in a run's memory=auto); where math would run a call, the plan keeps the weights in every call. For
    a CPU run, the run's own list (None: PyTorch's choice)."""
    names, dropout = attention_names(value), inner_dropouts(args)[0]
    if device == "cuda":
        kinds = [cuda_kernel(names, masked, half, dropout, args.d_model // args.n_heads,
                             torch.are_deterministic_algorithms_enabled()) for masked in (True, False)]
        return [SDPBackend.MATH] if "math" in kinds else [SDPBackend.FLASH_ATTENTION]
    if names is None:
        return None
    on_cpu = [BACKENDS[n] for n in names if n in CPU_KERNELS]
    if not on_cpu:
        raise ConfigError(f"trainer.attention={shown(names)}: the CPU has none of these kernels, only "
                          f"{' and '.join(CPU_KERNELS)}")
    if on_cpu == [SDPBackend.FLASH_ATTENTION] and dropout:
        raise ConfigError(f"trainer.attention={shown(names)}: the CPU's flash kernel runs no attention dropout "
                          f"(the model's is {dropout}); add math, or set model.attention_dropout=0")
    return on_cpu


def attention_kernels(kernels: list[SDPBackend] | None):
    """``sdpa_kernel`` over ``kernels`` in their order; None: whatever is set (PyTorch's choice by default)."""
    return contextlib.nullcontext() if kernels is None else sdpa_kernel(kernels, set_priority=True)


def check_attention(value, args: ModelArgs, device: torch.device, dtype: torch.dtype) -> None:
    """Runs one small attention call of each kind the model of ``args`` makes (masked: the encoder's self-attention
    and cross-attention; causal: the decoder's self-attention), forward and backward, at its head size and attention
    dropout and at the run's precision, under the chosen kernels (call inside ``attention_backends``): before the
    data is read, a setting that cannot run is refused by key."""
    names = attention_names(value)
    if names is None:
        return
    p = inner_dropouts(args)[0]
    q = torch.randn(1, args.n_heads, 4, args.d_model // args.n_heads, device=device, dtype=dtype, requires_grad=True)
    mask = torch.ones(1, 1, 1, 4, dtype=torch.bool, device=device)
    mask[..., -1] = False  # one padded key
    # training: forward and backward with dropout; decoding (no dropout, no gradient): one new position against
    # the source (masked) and, at its first step, against itself alone (a key of one position: cuDNN takes none)
    calls = (("masked (the encoder's and cross-attention)", q, q, p, {"attn_mask": mask}),
             ("causal (the decoder's self-attention)", q, q, p, {"is_causal": True}),
             ("decoding's cross-attention", q[:, :, :1].detach(), q.detach(), 0.0, {"attn_mask": mask}),
             ("decoding's first self-attention", q[:, :, :1].detach(), q[:, :, :1].detach(), 0.0, {}))
    for kind, query, key, dropout, kwargs in calls:
        try:
            with warnings.catch_warnings():  # PyTorch's reasons for each kernel it passed over
                warnings.simplefilter("ignore")
                out = F.scaled_dot_product_attention(query, key, key, dropout_p=dropout, **kwargs)
                if out.requires_grad:
                    out.sum().backward()
        except RuntimeError as e:
            raise ConfigError(
                f"trainer.attention={shown(names)}: none of these kernels runs the model's {kind} attention on "
                f"{device.type} in {str(dtype).removeprefix('torch.')} with attention dropout {dropout} "
                f"(PyTorch: {str(e).splitlines()[0].strip()}); add one that does, e.g. math, or set null") from None


MATMUL_PRECISIONS = ("highest", "high", "medium")


def check_matmul_precision(value) -> str:
    if value not in MATMUL_PRECISIONS:
        raise ConfigError(f"trainer.matmul_precision={value}: expected highest (fp32 products in fp32), high (TF32 on "
                          "a GPU of compute capability 8.0 or later) or medium (bf16 inside fp32 products)")
    return value


@contextlib.contextmanager
def matmul_precision(value: str):
    """trainer.matmul_precision: the arithmetic of the run's fp32 matrix products (``torch.set_float32_matmul_precision``;
    PyTorch's default, highest, keeps them fp32), restored afterwards, since a sweep's jobs share the process. high:
    TF32 on CUDA from compute capability 8.0 (10 mantissa bits), no change on the CPU; medium: bf16 (7 bits), on a
    GPU of compute capability 8.0 or later and on a CPU that oneDNN multiplies bf16 on (AVX-512 or AMX), elsewhere
    as high. Products under autocast (memory=amp) are bf16 or fp16 whatever this says."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(check_matmul_precision(value))
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool):
    """trainer.deterministic: for the run, PyTorch's deterministic kernels (``torch.use_deterministic_algorithms``;
    an operator that has none stops the run with PyTorch's message) and no cuDNN benchmarking; restored afterwards,
    since a sweep's jobs share the process. CUDA: cuBLAS reproduces its results only with a fixed workspace,
    ``CUBLAS_WORKSPACE_CONFIG=:4096:8``, set here unless given; cuBLAS reads it when the process first multiplies on
    the GPU, so a sweep that mixes settings should export it before it starts."""
    if not enabled:
        yield
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.benchmark)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.benchmark = before[2]
