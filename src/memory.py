"""Memory strategies and memory measurement.

A run's strategies come from the ``memory`` config group and compose (``memory=[amp,accum,truncate]``):

- ``amp``: autocast to ``bf16`` or ``fp16``; fp16 adds a GradScaler (see ``train.Trainer``);
- ``accum``: each optimizer step's batch is cut into ``accum_steps`` micro-batches whose gradients add up;
- ``truncate``: sources and targets are cut to ``max_src_len`` / ``max_tgt_len`` tokens.

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

    def __post_init__(self):
        if self.amp is not None and self.amp not in AMP_DTYPES:
            raise ConfigError(f"memory.amp={self.amp}: expected bf16, fp16 or null")
        if not isinstance(self.accum_steps, int) or self.accum_steps < 1:
            raise ConfigError(f"memory.accum_steps={self.accum_steps}: must be an integer >= 1")
        for key in ("max_src_len", "max_tgt_len"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"memory.{key}={value}: must be an integer >= 1, or null for no limit")

    @property
    def truncates(self) -> bool:
        return self.max_src_len is not None or self.max_tgt_len is not None

    @property
    def label(self) -> str:
        parts = [name for name, on in (("amp", self.amp), ("accum", self.accum_steps > 1), ("truncate", self.truncates)) if on]
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


def strategy_label(memory: dict) -> str:
    """The label of a ``memory`` config (a plain dict), e.g. ``amp+accum``."""
    return MemoryStrategy(**memory).label


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
