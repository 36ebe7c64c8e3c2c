"""Memory strategies and memory measurement.

A run's strategies come from the ``memory`` config group and compose (``memory=[amp,accum,checkpoint]``); each
is one file in ``conf/memory/`` and one place in ``src/``:

- ``amp``: autocast to ``bf16`` or ``fp16``; fp16 adds a GradScaler (``trainer.Trainer``);
- ``accum``: each optimizer step's batch runs as ``accum_steps`` micro-batches whose gradients add up
  (``trainer.Trainer.step``, ``data.batching.split_batch``);
- ``truncate``: training sources and targets over ``max_src_len`` / ``max_tgt_len`` tokens are cut, or their pairs
  dropped (``overlong``) (``data.batching.limit_lengths``);
- ``tokens``: batches under a token budget, padding counted (``data.max_tokens``; ``data.batching``);
- ``checkpoint``: activation checkpointing per encoder and decoder layer (``model.Transformer``);
- ``chunked_ce``: output projection and loss over ``loss_chunk`` target positions at a time
  (``trainer.chunked_loss``);
- ``trim_vocab``: the vocabulary cut to the pieces the training data uses (``tokenizers.TrimmedCodec``).

The label of a run (``amp+accum``) is derived from these settings, never typed by hand.

Peak memory: on CUDA the allocator's ``max_memory_allocated``; on the CPU, where PyTorch keeps no such
statistic, ``TensorMemoryTracker`` adds up the bytes of every live tensor storage as operators create them.
"""

from __future__ import annotations

import contextlib
import resource
import sys
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from .errors import ConfigError

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class MemoryStrategy:
    amp: str | None = None  # "bf16" | "fp16" | None (fp32)
    accum_steps: int = 1
    max_src_len: int | None = None
    max_tgt_len: int | None = None
    overlong: str = "truncate"  # or "drop"
    checkpoint: bool = False
    loss_chunk: int | None = None  # target positions per chunk of the output projection and loss
    trim_vocab: bool = False
    max_tokens: int | None = None  # data.max_tokens: the token budget of one optimizer step's batch

    def __post_init__(self):
        if self.amp is not None and self.amp not in AMP_DTYPES:
            raise ConfigError(f"memory.amp={self.amp}: expected bf16, fp16 or null")
        if self.overlong not in ("truncate", "drop"):
            raise ConfigError(f"memory.overlong={self.overlong}: expected truncate or drop")
        for key, minimum in (("accum_steps", 1), ("max_src_len", 1), ("max_tgt_len", 1), ("loss_chunk", 1),
                             ("max_tokens", 2)):
            value = getattr(self, key)
            if key != "accum_steps" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                where = "data" if key == "max_tokens" else "memory"
                raise ConfigError(f"{where}.{key}={value}: must be an integer >= {minimum}" + (", or null" if key != "accum_steps" else ""))
        for key in ("checkpoint", "trim_vocab"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"memory.{key}={getattr(self, key)}: expected true or false")

    @property
    def truncates(self) -> bool:
        return self.max_src_len is not None or self.max_tgt_len is not None

    @property
    def label(self) -> str:
        parts = [
            name
            for name, on in (
                ("amp", self.amp),
                ("accum", self.accum_steps > 1),
                ("truncate", self.truncates),
                ("tokens", self.max_tokens),
                ("checkpoint", self.checkpoint),
                ("chunked_ce", self.loss_chunk),
                ("trim_vocab", self.trim_vocab),
            )
            if on
        ]
        return "+".join(parts) or "none"

    @property
    def amp_dtype(self) -> torch.dtype | None:
        return AMP_DTYPES[self.amp] if self.amp else None

    def autocast(self, device: torch.device):
        if self.amp is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.amp_dtype)

    def check_device(self, device: torch.device) -> None:
        if self.amp == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ConfigError(f"memory.amp=bf16: {torch.cuda.get_device_name(device)} has no bf16; use memory.amp=fp16")


def memory_strategy(memory: dict, max_tokens: int | None = None) -> MemoryStrategy:
    """The strategy of a ``memory`` config (a plain dict) and ``data.max_tokens``."""
    try:
        return MemoryStrategy(**memory, max_tokens=max_tokens)
    except TypeError as e:
        known = ", ".join(f for f in MemoryStrategy.__dataclass_fields__ if f != "max_tokens")
        raise ConfigError(f"memory: {e} (known keys: {known})") from None


def strategy_label(memory: dict, max_tokens: int | None = None) -> str:
    """The label of a ``memory`` config, e.g. ``amp+accum``."""
    return memory_strategy(memory, max_tokens).label


class TensorMemoryTracker(TorchDispatchMode):
    """Live and peak bytes of tensor storages on one device type.

    Every operator's outputs are inspected as they are created; each new storage is counted once and uncounted
    when it is freed (a weak reference's finalizer), so views and in-place results cost nothing. Storages that
    exist before tracking starts (parameters, gradients, optimizer state) are added with ``track``.
    """

    def __init__(self, device_type: str = "cpu"):
        super().__init__()
        self.device_type = device_type
        self.live = 0
        self.peak = 0
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def track(self, *tensors) -> None:
        for t in tree_leaves(tensors):
            if not isinstance(t, torch.Tensor) or t.device.type != self.device_type:
                continue
            storage = t.untyped_storage()
            if storage in self._seen:
                continue
            nbytes = storage.nbytes()
            self._seen[storage] = nbytes
            weakref.finalize(storage, self._free, nbytes)
            self.live += nbytes
            if self.live > self.peak:
                self.peak = self.live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.track(out)
        return out

    def reset_peak(self) -> None:
        self.peak = self.live


class PeakMemory:
    """Peak tensor memory of a run's training steps: CUDA's allocator statistics, or the tracker on the CPU.

    Read in windows (one per log line); ``skip_window`` drops what happened outside training (evaluation)."""

    def __init__(self, device: torch.device, track_cpu: bool = True):
        self.device = device
        self.tracker = TensorMemoryTracker(device.type) if device.type != "cuda" and track_cpu else None
        self.run_peak = 0
        self.run_reserved = 0

    @property
    def available(self) -> bool:
        return self.device.type == "cuda" or self.tracker is not None

    def track_state(self, *tensors) -> None:
        if self.tracker is not None:
            self.tracker.track(*tensors)

    def measure(self):
        """Context for the code whose memory is measured (a training step)."""
        return self.tracker if self.tracker is not None else contextlib.nullcontext()

    def window_peak_mb(self) -> float | None:
        """Peak since the last call, in MiB; starts a new window."""
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
            self.run_reserved = max(self.run_reserved, torch.cuda.max_memory_reserved(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.tracker is not None:
            peak = self.tracker.peak
            self.tracker.reset_peak()
        else:
            return None
        self.run_peak = max(self.run_peak, peak)
        return peak / 2**20

    def skip_window(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.tracker is not None:
            self.tracker.reset_peak()

    def run_peak_mb(self) -> float | None:
        return self.run_peak / 2**20 if self.available else None

    def run_reserved_mb(self) -> float | None:
        return self.run_reserved / 2**20 if self.device.type == "cuda" else None


def reset_peak_rss() -> None:
    """Start a new peak-RSS measurement, so each run of a sweep (one process) reports its own peak. Linux
    resets the high-water mark on writing 5 to /proc/self/clear_refs; elsewhere the process peak stays."""
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_mb() -> float:
    """Peak resident set size since ``reset_peak_rss`` (Linux VmHWM), else of the whole process."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/self/status") as f:
            line = next(line for line in f if line.startswith("VmHWM:"))
        return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 / (1024 if sys.platform == "darwin" else 1)
