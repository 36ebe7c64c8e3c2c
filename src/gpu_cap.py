"""trainer.gpu_gb: train on a larger GPU as on a card of that many GB.

A lab's 80 GB card, capped with ``trainer.gpu_gb=12``, runs out of memory where a student's 12 GB card would: the
caching allocator refuses to hold more than the card leaves beside its CUDA context (``plan.context_gb``, 0.5 GB,
as the planner counts it; a real context takes 300-600 MiB), and raises the ``torch.OutOfMemoryError`` that card
would raise, where it would (``torch.cuda.set_per_process_memory_fraction``). So a config, a planner's verdict,
memory=auto's choice or the out-of-memory back-off can be checked for a card one does not have. The cap counts what
the allocator reserves (its rounding and fragmentation included), not memory allocated outside it (NCCL's buffers,
the context itself).
"""

from __future__ import annotations

import contextlib
import logging

import torch

from .errors import ConfigError
from .planner import GiB

log = logging.getLogger(__name__)


def cap_fraction(gpu_gb: float, context_gb: float, total_bytes: int, name: str = "this GPU") -> float:
    """The fraction of a card of ``total_bytes`` that a card of ``gpu_gb`` leaves to the allocator beside a CUDA
    context of ``context_gb`` (GB of 2^30 bytes, as plan.gpu_gb)."""
    if gpu_gb <= context_gb:
        raise ConfigError(f"trainer.gpu_gb={gpu_gb:g}: not more than the {context_gb:g} GB of the CUDA context "
                          "(plan.context_gb) that a card holds beside what the run allocates; give the card's memory")
    if gpu_gb * GiB >= total_bytes:
        raise ConfigError(f"trainer.gpu_gb={gpu_gb:g}: {name} has {total_bytes / GiB:.1f} GB, not more; a cap "
                          "emulates a smaller card (null: the whole card)")
    return (gpu_gb - context_gb) * GiB / total_bytes


@contextlib.contextmanager
def gpu_memory_cap(gpu_gb: float | None, context_gb: float, device: torch.device):
    """For the run, cap ``device``'s caching allocator at what a card of ``gpu_gb`` leaves beside its CUDA context;
    the whole card again afterwards, since a sweep's jobs share the process. None: no cap."""
    if gpu_gb is None:
        yield
        return
    if device.type != "cuda":
        raise ConfigError(f"trainer.gpu_gb={gpu_gb:g}: caps a GPU's memory, and this run trains on the {device.type} "
                          "(trainer.device); leave it null there")
    props = torch.cuda.get_device_properties(device)
    fraction = cap_fraction(gpu_gb, context_gb, props.total_memory, props.name)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    log.info("trainer.gpu_gb=%g: the allocator may hold %.2f GB of %s's %.1f GB, as a %g GB card leaves beside its "
             "%g GB CUDA context", gpu_gb, gpu_gb - context_gb, props.name, props.total_memory / GiB, gpu_gb,
             context_gb)
    try:
        yield
    finally:
        with contextlib.suppress(RuntimeError):  # a CUDA error that stopped the run is the one to see
            torch.cuda.set_per_process_memory_fraction(1.0, device)
