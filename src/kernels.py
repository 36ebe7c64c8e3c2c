"""trainer.attention: which of PyTorch's scaled-dot-product-attention kernels the run's attention may use.

Left at null, PyTorch picks for each call; on an H200 (torch 2.11) it picked cuDNN's attention. A list names the
kernels allowed, in order of preference (``torch.nn.attention.sdpa_kernel`` with ``set_priority``):
``[flash, efficient]`` runs flash attention where it can (the decoder's causal self-attention; it takes no padding
mask) and memory-efficient attention elsewhere; on the H200 that was 8-9% faster than PyTorch's choice for
model=base at bf16, about as much as one setting varied from run to run there (experiments/throughput).
``check_attention`` refuses, at the start and naming the key, a list that runs none of the model's attention calls
on the run's device, precision and dropout; ``planned_attention`` tells the planner what the chosen kernels keep.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .errors import ConfigError
from .model import ModelArgs, inner_dropouts

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
CPU_KERNELS = ("flash", "math")  # flash only without dropout


def _shown(value) -> str:
    return f"[{','.join(map(str, value))}]" if isinstance(value, (list, tuple)) else str(value)


def attention_names(value) -> list[str] | None:
    """trainer.attention as a list of kernel names (one name alone is a list of one); null: PyTorch's choice."""
    if value is None:
        return None
    names = [value] if isinstance(value, str) else list(value)
    unknown = [n for n in names if n not in BACKENDS]
    if not names or unknown or len(set(names)) < len(names):
        why = f"unknown {', '.join(map(str, unknown))}" if unknown else "empty" if not names else "a kernel named twice"
        raise ConfigError(f"trainer.attention={_shown(value)}: {why}; expected a list of {', '.join(BACKENDS)} in order of "
                          "preference (e.g. [flash,efficient]), or null for PyTorch's choice")
    return names


def attention_backends(value):
    """The run's attention kernels (trainer.attention) as a context, restored afterwards: a sweep's jobs share
    the process."""
    names = attention_names(value)
    return attention_kernels(None if names is None else [BACKENDS[n] for n in names])


def planned_attention(value, device: str, half: bool) -> list[SDPBackend] | None:
    """The CPU kernels the planner's fake step (src/planner.py) attends with, to keep for backward what the
    run's kernels on ``device`` keep, at half precision (autocast) or fp32. CUDA's fused kernels (flash, efficient,
    cuDNN) keep their inputs, output and log-sum-exp, as the CPU's flash kernel does (run without dropout: CUDA's
    draw it again in backward); math keeps the attention weights (and dropout's mask), as it does on the CPU. On
    CUDA a call runs the first kernel of the list that takes it: flash and cuDNN take half precision only, and flash
    no padding mask; where math would run any call, the plan keeps the weights in every call. For a CPU run, the
    run's own list (None: PyTorch's choice, a fused kernel wherever one applies)."""
    names = attention_names(value)
    if device == "cuda":
        fused = {"efficient"} | ({"flash", "cudnn"} if half else set())
        takes = (fused - {"flash"}, fused)  # the masked calls' kernels, the causal calls'
        first = [next((n for n in (names or ["efficient"]) if n in kinds or n == "math"), "math") for kinds in takes]
        return [SDPBackend.MATH] if "math" in first else [SDPBackend.FLASH_ATTENTION]
    if names is None:
        return None
    on_cpu = [BACKENDS[n] for n in names if n in CPU_KERNELS]
    if not on_cpu:
        raise ConfigError(f"trainer.attention={_shown(names)}: the CPU has none of these kernels, only "
                          f"{' and '.join(CPU_KERNELS)}")
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
    calls = (("masked (the encoder's and cross-attention)", {"attn_mask": mask}),
             ("causal (the decoder's self-attention)", {"is_causal": True}))
    for kind, kwargs in calls:
        try:
            with warnings.catch_warnings():  # PyTorch's reasons for each kernel it passed over
                warnings.simplefilter("ignore")
                F.scaled_dot_product_attention(q, q, q, dropout_p=p, **kwargs).sum().backward()
        except RuntimeError as e:
            raise ConfigError(
                f"trainer.attention={_shown(names)}: none of these kernels runs the model's {kind} attention on "
                f"{device.type} in {str(dtype).removeprefix('torch.')} with attention dropout {p} "
                f"(PyTorch: {str(e).splitlines()[0].strip()}); add one that does, e.g. math, or set null") from None
