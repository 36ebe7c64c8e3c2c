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
import copy
import ctypes
import functools
import gc
import logging
import math
import platform
import resource
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .config_check import check_known_keys
from .distributed import ddp_bucket_bytes
from .errors import ConfigError, check_int
from .fileio import write_json

log = logging.getLogger(__name__)
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
    auto: bool = False  # memory=auto: the planner picks accumulation, then amp, then checkpointing to fit budget_gb
    budget_gb: float | None = None
    # out-of-memory back-offs (twice the accumulation each) before a run fails; None: 3 in one process, none under
    # torchrun (see backoffs)
    oom_retries: int | None = None
    fsdp: bool = False  # under torchrun: shard parameters, gradients and optimizer state over the ranks (FSDP2)
    # memory=[fsdp,amp]: "bf16" gathers each unit's parameters in bf16 and computes in it (FSDP2's
    # MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)); None: gathered in fp32, cast by autocast
    fsdp_param_dtype: str | None = None
    max_tokens: int | None = None  # data.max_tokens: the token budget of one optimizer step's batch

    def __post_init__(self):
        if self.amp is not None and self.amp not in AMP_DTYPES:
            raise ConfigError(f"memory.amp={self.amp}: expected bf16, fp16 or null")
        if self.overlong not in ("truncate", "drop"):
            raise ConfigError(f"memory.overlong={self.overlong}: expected truncate or drop")
        check_int("memory.accum_steps", self.accum_steps, 1)
        for key in ("max_src_len", "max_tgt_len", "loss_chunk"):
            check_int(f"memory.{key}", getattr(self, key), 1, nullable=True)
        check_int("data.max_tokens", self.max_tokens, 2, nullable=True)
        for key in ("checkpoint", "trim_vocab", "auto", "fsdp"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"memory.{key}={getattr(self, key)}: expected true or false")
        check_int("memory.oom_retries", self.oom_retries, 0, nullable=True)
        if self.fsdp and self.oom_retries:
            raise ConfigError(f"memory.oom_retries={self.oom_retries} with memory=fsdp: FSDP reduce-scatters gradients "
                              "inside every backward pass, so its ranks cannot redo a step together; set it to 0 or "
                              "null, and plan first (plan.py)")
        if self.fsdp_param_dtype is not None and (self.fsdp_param_dtype != "bf16" or not self.fsdp
                                                  or self.amp != "bf16"):
            raise ConfigError(f"memory.fsdp_param_dtype={self.fsdp_param_dtype}: expected bf16 with memory=[fsdp,amp] "
                              "and memory.amp=bf16 (FSDP gathers the parameters in bf16 and autocast computes in it), "
                              "or null")
        budget = self.budget_gb
        if self.auto and not (isinstance(budget, (int, float)) and not isinstance(budget, bool) and budget > 0
                              and math.isfinite(budget)):
            raise ConfigError(f"memory.budget_gb={self.budget_gb}: memory=auto needs the memory budget in GB, "
                              "e.g. memory.budget_gb=12 (by default a GPU run's trainer.gpu_gb)")

    def backoffs(self, distributed: bool) -> int:
        """How many out-of-memory back-offs a step may take: memory.oom_retries, or by default 3 in one process
        and none under torchrun. There, backing off means that every rank redoes the step, so the ranks must agree
        on one rank's error after backward, and the gradients are then all-reduced after backward rather than
        overlapped with it, as DDP does (src/trainer.py): asked for by setting memory.oom_retries."""
        if self.oom_retries is not None:
            return self.oom_retries
        return 0 if distributed else 3

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
                ("fsdp(bf16)" if self.fsdp_param_dtype else "fsdp", self.fsdp),
            )
            if on
        ]
        label = "+".join(parts) or "none"
        return f"auto({label})" if self.auto else label

    @property
    def param_dtype(self) -> torch.dtype | None:
        """memory.fsdp_param_dtype's dtype: what FSDP gathers the parameters in (None: theirs, fp32)."""
        return AMP_DTYPES[self.fsdp_param_dtype] if self.fsdp_param_dtype else None

    @property
    def amp_dtype(self) -> torch.dtype | None:
        return AMP_DTYPES[self.amp] if self.amp else None

    def autocast(self, device: torch.device):
        if self.amp is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.amp_dtype)

    def check_device(self, device: torch.device) -> None:
        """bf16 on a GPU that cannot hold it is refused (fp16 needs its GradScaler: the choice is the user's); on
        a GPU before compute capability 8.0, which PyTorch emulates it on, it runs, saving the memory and not the
        time: a warning says that fp16 is that card's half precision. fp16 on the CPU runs, without native fp16
        products, so it is slow there: a warning says to use bf16. bf16 on a CPU that oneDNN cannot multiply it on
        (no AVX-512) falls back to a plain loop, far slower: a warning says so."""
        if self.amp == "bf16" and device.type == "cuda":
            name = torch.cuda.get_device_name(device)
            if not torch.cuda.is_bf16_supported():
                raise ConfigError(f"memory.amp=bf16: {name} has no bf16; use memory.amp=fp16")
            if not native_bf16(device):
                log.warning("memory.amp=bf16 on %s (compute capability %d.%d): PyTorch emulates bf16 on GPUs before "
                            "compute capability 8.0, which saves the memory but not the time; memory.amp=fp16 is "
                            "this card's half precision (with a GradScaler)", name,
                            *torch.cuda.get_device_capability(device))
        if self.amp == "fp16" and device.type == "cpu":
            log.warning("memory.amp=fp16 on the CPU: it runs, but CPUs multiply fp16 slowly (2,169 against 20,279 "
                        "tokens/s in fp32 for model=tiny on 2 AMD EPYC cores); memory.amp=bf16 is the CPU's half precision")
        if self.amp == "bf16" and device.type == "cpu" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            log.warning("memory.amp=bf16 on a CPU without AVX-512: it runs, but PyTorch multiplies bf16 here without "
                        "oneDNN, far slower than fp32 (1,474 against 13,881 tokens/s for model=tiny, matrix products "
                        "0.5 against 83 GFLOP/s, on 2 AMD EPYC cores with AVX2); it still saves the memory it saves")


def native_bf16(device: torch.device) -> bool:
    """Whether a CUDA device multiplies bf16 in hardware: compute capability 8.0 (Ampere) or later, or a ROCm GPU.
    ``torch.cuda.is_bf16_supported()`` answers True on older cards too (a V100, a T4, an RTX 2080 Ti), where
    PyTorch emulates bf16 in fp32 arithmetic."""
    if torch.version.hip:
        return True
    return torch.cuda.is_available() and torch.cuda.get_device_capability(device)[0] >= 8


def half_precision(device: torch.device) -> str:
    """The half precision memory=auto trains in on ``device`` when it needs amp: bf16 (no GradScaler), or fp16 on
    a GPU without bf16 arithmetic, where emulated bf16 saves the memory and not the time (its tensor cores, from
    compute capability 7.0, multiply fp16)."""
    return "fp16" if device.type == "cuda" and not native_bf16(device) else "bf16"


def memory_strategy(memory: dict, max_tokens: int | None = None) -> MemoryStrategy:
    """The strategy of a ``memory`` config (a plain dict) and ``data.max_tokens``."""
    check_known_keys("memory", memory, (f for f in MemoryStrategy.__dataclass_fields__ if f != "max_tokens"))
    return MemoryStrategy(**memory, max_tokens=max_tokens)


# ``gathered``: memory=fsdp's parameters all-gathered from the shards, live while their unit computes (the root
# unit's from its forward to its backward); 0 in any other run, and left out of tables where every row has 0.
CATEGORIES = ("parameters", "gathered", "gradients", "optimizer", "activations", "logits", "backward")
_ACTIVE: list[TensorMemoryTracker] = []  # trackers inside their ``with`` block, innermost last


def shown_categories(splits) -> tuple[str, ...]:
    """The columns of a table of ``splits`` (dicts by category, in bytes or MiB): ``CATEGORIES``, without
    ``gathered`` where no split has any (no run of the table was sharded)."""
    splits = list(splits)
    return tuple(c for c in CATEGORIES if c != "gathered" or any(split.get(c) for split in splits))


def count_inputs(*tensors: torch.Tensor) -> None:
    """Count a step's input tensors, made before it began (a CPU batch; on CUDA their copies to the device are
    allocations the tracker sees), on the trackers inside their ``with`` block."""
    for tracker in _ACTIVE:
        tracker.track(tensors)


@contextlib.contextmanager
def region(category: str):
    """Tag the storages created inside the block with ``category`` when a tracker is active; free otherwise.

    The training step marks its parts: the output projection and loss (``logits``), backward (``backward``:
    activation gradients and recomputed activations), the optimizer step (``optimizer``); other forward storages
    are ``activations``. Parameter gradients are re-tagged ``gradients`` once accumulated."""
    if not _ACTIVE:
        yield
        return
    if category not in CATEGORIES:
        raise ValueError(f"region({category!r}): not one of {CATEGORIES}")
    tracker = _ACTIVE[-1]
    previous, tracker.category = tracker.category, category
    try:
        yield
    finally:
        tracker.category = previous


def _local(t: torch.Tensor) -> torch.Tensor:
    """What a tensor holds in this process: a DTensor's (memory=fsdp) local shard, else the tensor itself. A DTensor
    exists only once its module is imported (by FSDP), so importing it here, 0.8 s at every start, is left to FSDP."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return t._local_tensor if dtensor is not None and isinstance(t, dtensor.DTensor) else t


@functools.cache
def _aliases(func) -> bool:
    """Whether an operator's results are (views of) its arguments: views, in-place operators and the in-place
    collectives of ``c10d``. They allocate nothing, also where the storage is one the tracker never saw (one that
    existed before tracking started, such as DDP's gradient buckets written in backward). Not ``lift_fresh``: its
    argument is the tensor that ``torch.tensor(...)`` has just made without an operator (Adam's ``step``, say)."""
    return func.namespace == "c10d" or (
        func is not torch.ops.aten.lift_fresh.default and any(r.alias_info is not None for r in func._schema.returns))


_RESIZE = torch.UntypedStorage.resize_


def _tracked_resize(storage, size):
    out = _RESIZE(storage, size)
    for tracker in _ACTIVE:
        tracker.resized(storage, storage.nbytes())
    return out


def _fsdp_patches() -> list[tuple[type, str, object]]:
    """memory=fsdp: what FSDP2 allocates in a step, told to the trackers, as (class, name, replacement) for the
    methods of its ``FSDPParamGroup`` (torch 2.13's; none if FSDP is not loaded or they changed):

    - ``unshard`` and ``wait_for_unshard``: the all-gather's buffers and the gathered parameters are ``gathered``.
      A unit's gathered parameters keep their storages between steps, freed with ``resize_(0)`` and gathered again
      into them: they are tracked (at 0 bytes) before each gathering, so that a tracker started after the first
      step sees them grow. Without this a step after the first did not count them at all, and the first counted
      them as activations.
    - ``post_backward``: the unit's unsharded gradients, the reduce-scatter's buffers and the sharded gradients it
      leaves are ``gradients`` (no post-accumulate hook of the sharded parameters runs for them)."""
    group_module = sys.modules.get("torch.distributed.fsdp._fully_shard._fsdp_param_group")
    group = getattr(group_module, "FSDPParamGroup", None)
    if group is None or not {"unshard", "wait_for_unshard", "post_backward"} <= vars(group).keys():
        return []
    unshard, wait_for_unshard, post_backward = group.unshard, group.wait_for_unshard, group.post_backward

    def tracked_unshard(self, *args, **kwargs):
        with region("gathered"):
            return unshard(self, *args, **kwargs)

    def tracked_wait_for_unshard(self):
        for tracker in _ACTIVE:
            tracker.track([p.all_gather_outputs for p in self.fsdp_params], category="gathered")
        with region("gathered"):
            return wait_for_unshard(self)

    def tracked_post_backward(self, *unused):
        for tracker in _ACTIVE:
            for p in self.fsdp_params:
                unsharded = getattr(p, "_unsharded_param", None)
                for grad in (p.unsharded_accumulated_grad, None if unsharded is None else unsharded.grad):
                    if grad is not None:
                        tracker.retag(grad, "gradients")
        with region("gradients"):
            return post_backward(self, *unused)

    return [(group, "unshard", tracked_unshard), (group, "wait_for_unshard", tracked_wait_for_unshard),
            (group, "post_backward", tracked_post_backward)]


_UNPATCHED: list[tuple[type, str, object]] = []  # the methods ``_fsdp_patches`` replaced while trackers are active


def _patch(active: bool) -> None:
    """Install (the first tracker entering) or remove (the last leaving) the tracker's hooks into PyTorch: storage
    resizing and FSDP's gathering and reduce-scattering."""
    if active:
        torch.UntypedStorage.resize_ = _tracked_resize
        for owner, name, replacement in _fsdp_patches():
            _UNPATCHED.append((owner, name, owner.__dict__[name]))
            setattr(owner, name, replacement)
    else:
        torch.UntypedStorage.resize_ = _RESIZE
        while _UNPATCHED:
            setattr(*_UNPATCHED.pop())


class TensorMemoryTracker(TorchDispatchMode):
    """Live and peak bytes of tensor storages on one device type, split by category (``CATEGORIES``).

    Every operator's outputs are inspected as they are created; each new storage is counted once and uncounted
    when it is freed (a weak reference's finalizer), so views and in-place results cost nothing. Storages that
    exist before tracking starts (parameters, optimizer state) are added with ``track``. The split at the peak
    is kept in ``peak_by_category``.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """Not wrapped in ``torch._disable_dynamo`` at every operator (a third of the tracker's cost): tracking is
        off under ``torch.compile`` (src/run.py), so Dynamo never meets this mode."""
        return False

    def __init__(self, device_type: str = "cpu"):
        super().__init__()
        self.device_type = device_type
        self.live = 0
        self.peak = 0
        self.at_start = 0  # the live bytes when a step began (set by tracked_step)
        self.category = "activations"
        self.live_by_category = dict.fromkeys(CATEGORIES, 0)
        self.peak_by_category = dict(self.live_by_category)
        self._seen: dict[int, list] = {}  # live storage (its address, ``_cdata``) -> [bytes, category]
        self.held = 0  # bytes of DDP's gradient buckets counted without their storages (``hold_buckets``)
        self.ddp = False  # whether it holds DDP's buckets: its collectives in backward write them (memory=fsdp's do not)
        self._hooks: list = []
        self._pending: tuple | None = None  # an accumulation in backward, its moment not yet counted (``_settle``)

    def __enter__(self):
        if not _ACTIVE:
            _patch(True)
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        self._settle()
        _ACTIVE.remove(self)
        if not _ACTIVE:
            _patch(False)
        return super().__exit__(*exc)

    def resized(self, storage, nbytes: int) -> None:
        """A tracked storage changed size in place: FSDP frees a gathered parameter with ``resize_(0)`` and
        gathers it again into the same storage (no operator a dispatch mode sees)."""
        entry = self._seen.get(storage._cdata)
        if entry is not None:
            self._grow(nbytes - entry[0], entry[1])
            entry[0] = nbytes

    def _free(self, key: int, _ref=None) -> None:
        nbytes, category = self._seen.pop(key)[:2]
        self.live -= nbytes
        self.live_by_category[category] -= nbytes

    def track(self, *tensors, category: str | None = None) -> None:
        for t in tree_leaves(tensors):
            if isinstance(t, torch.Tensor):
                self._track(t, category or self.category)

    def _track(self, t: torch.Tensor, category: str, into: tuple[int, ...] = ()) -> None:
        if t.device.type != self.device_type:
            return
        storage = _local(t).untyped_storage()
        key = storage._cdata
        if key in self._seen:
            return
        nbytes = storage.nbytes()
        # uncounted when the storage is freed: its Python object lives as long as it does. A weak reference (kept in
        # the entry) rather than weakref.finalize, which costs more and keeps a finished tracker alive.
        self._seen[key] = [nbytes, category, weakref.ref(storage, functools.partial(self._free, key)), _autograd_node()]
        self._grow(nbytes, category, tuple(k for k in into if k in self._seen))

    def _grow(self, nbytes: int, category: str, into: tuple[int, ...] = ()) -> None:
        self.live += nbytes
        self.live_by_category[category] = self.live_by_category.get(category, 0) + nbytes
        if into:  # its moment counts only if the step without a dispatch mode has it too (``_settle``)
            self._pending = (self.live, dict(self.live_by_category), into)
        elif self.live > self.peak:
            self.peak = self.live
            self.peak_by_category = dict(self.live_by_category)

    def hold_buckets(self, nbytes: int) -> None:
        """Count DDP's gradient buckets, ``nbytes`` that its C++ reducer allocated before tracking started (no
        operator showed them to this tracker), as gradients. They are held as a number of bytes until backward's
        all-reduce shows their storages (``_buckets``); from then on they are tracked like any other storage."""
        self.held += nbytes
        self.ddp = self.ddp or nbytes > 0
        self._grow(nbytes, "gradients")

    def _buckets(self, out) -> None:
        """The storages that a collective (a ``c10d`` operator) wrote in place during backward: DDP's gradient
        buckets. Unseen ones were allocated at DDP's construction: their bytes move from the held count to tracked
        storages, so that their end is seen when DDP rebuilds them at the second step's forward (where the Trainer
        tags the new ones gradients)."""
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type != self.device_type:
                continue
            storage = _local(t).untyped_storage()
            if storage._cdata in self._seen:
                continue
            taken = min(self.held, storage.nbytes())
            self.held -= taken
            self._grow(-taken, "gradients")
            self._track(t, "gradients")

    def retag(self, tensor: torch.Tensor, category: str) -> None:
        """Move a tracked tensor's storage to another category (e.g. a parameter's new gradient)."""
        entry = self._seen.get(_local(tensor).untyped_storage()._cdata)
        if entry is not None and entry[1] != category:
            self.live_by_category[entry[1]] -= entry[0]
            self.live_by_category[category] = self.live_by_category.get(category, 0) + entry[0]
            entry[1] = category

    def watch(self, model: torch.nn.Module) -> None:
        """Track the model's parameters and buffers, and tag each gradient ``gradients`` once accumulated."""
        self.track(list(model.parameters()), list(model.buffers()), category="parameters")
        for p in model.parameters():
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(lambda p: self.retag(p.grad, "gradients")))

    def unwatch(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def _settle(self) -> None:
        """Count an accumulation's moment (``_accumulated``) in the peak, unless the first gradient it added was
        freed before the next operator: autograd's engine, holding the last reference to it, adds into it in place
        when no Python dispatch mode holds one more, as this tracker's and the planner's fake tensors do, so the sum
        never coexists with both. Where the first lives on, the sum was made beside it without a mode too."""
        if self._pending is not None:
            live, split, inputs = self._pending
            self._pending = None
            if all(key in self._seen for key in inputs) and live > self.peak:
                self.peak, self.peak_by_category = live, split

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._pending is not None:
            self._settle()
        out = func(*args, **(kwargs or {}))
        if not _aliases(func):
            if isinstance(out, torch.Tensor):  # most operators: no tree to walk
                into = _accumulated(args, kwargs, out) if func is _ADD else ()
                if into and self._seen.get(into[0], (None,) * 4)[3] == _autograd_node():
                    into = ()  # made by the node now running: its formula's own sum, out of place without a mode too
                self._track(out, self.category, into)
            else:
                self.track(out)
        elif self.ddp and func.namespace == "c10d" and self.category == "backward":
            self._buckets(out)
        return out

    def reset_peak(self) -> None:
        self._settle()
        self.peak = self.live
        self.peak_by_category = dict(self.live_by_category)


_ADD = torch.ops.aten.add.Tensor


def _accumulated(args, kwargs, out: torch.Tensor) -> tuple[int, ...]:
    """Of an ``add``: where autograd's engine adds two gradients of one tensor (its ``InputBuffer``: an ``add`` in
    backward, outside grad mode) and could have added the second into the first in place, the first's storage; else
    nothing. The engine adds in place where it holds the last reference to the first gradient and to its storage,
    a tensor that is the whole of its storage, of the sum's shape and dtype; under a Python dispatch mode (this
    tracker, the planner's fake tensors) it never does, since the mode's Python objects hold one more reference to
    the tensor. The storage's references still tell (``_one_holder``); the tensor's cannot, so ``_settle`` asks,
    too, that the first gradient be freed before the next operator, as it is where the engine held the last
    reference. Not where both operands are one tensor (the engine then holds it twice), either is a subclass, or
    the first was made by the node now running (an ``add`` in a backward formula, made out of place without a mode
    too: ``var_mean``'s, a custom Function's). Without this, a step whose peak is such a sum (model=base, XLM-R's
    tied vocabulary, amp, the chunked loss) was counted 488 MiB, one fp32 gradient of the embedding, above what it
    allocates: torch.profiler's memory timeline on the CPU, CUDA's allocator on an H200."""
    if (kwargs or torch.is_grad_enabled() or torch._C._current_graph_task_id() == -1 or args[0] is args[1]
            or not (_plain(args[0]) and _plain(args[1]))):
        return ()
    first = _local(args[0])
    storage = first.untyped_storage()
    if (first.dtype == out.dtype and first.shape == out.shape and first.storage_offset() == 0
            and storage.nbytes() == first.numel() * first.element_size()
            and torch._C._storage_Use_Count(storage._cdata) == _one_holder()):
        return (storage._cdata,)
    return ()


def _plain(t) -> bool:
    """A tensor autograd may add into in place: no subclass (a DTensor, say), but for the planner's fake tensors,
    which stand for plain ones."""
    if type(t) is torch.Tensor:
        return True
    fake = sys.modules.get("torch._subclasses.fake_tensor")
    return fake is not None and isinstance(t, fake.FakeTensor)


def _autograd_node() -> tuple | None:
    """The autograd node whose backward is running (its name and sequence number); None outside backward."""
    if torch._C._current_graph_task_id() == -1:
        return None
    node = torch._C._current_autograd_node()
    return None if node is None else (node.name(), node._sequence_nr())


@functools.cache
def _one_holder() -> int:
    """What ``torch._C._storage_Use_Count`` says, asked from Python, of a storage that one tensor alone holds (the
    Python object that asks holds it too)."""
    tensor = torch.empty(1)
    storage = tensor.untyped_storage()  # both alive while asked: the count is read through the storage's address
    return torch._C._storage_Use_Count(storage._cdata)


def optimizer_state(optimizer: torch.optim.Optimizer) -> list:
    """The optimizer's per-parameter state (Adam's step and moments)."""
    return [t for state in optimizer.state.values() for t in state.values()]


def create_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give the optimizer its per-parameter state (Adam's step and moments), as every step after the first has it,
    without a forward and backward pass: one step on zero gradients, which moves no parameter (Adam's first moment
    is zero)."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


class LayerWindows(TensorMemoryTracker):
    """A tracker that also follows the backward of each encoder and decoder layer, from its output's gradient to
    its input's (``open``, ``close``): ``windows`` gets, for each in the order backward reaches them, the split at
    its highest moment of what was made since it began, as (activations and logits alive then, backward
    temporaries and parameter gradients made since it began, and the parameter gradients made before it began,
    since the step began). That is what a layer's backward adds under memory=fsdp, whose other parts (gathered
    parameters, gradient shards) the planner knows: a checkpointed layer's recomputed activations are in its
    window; the embeddings' gradients, made after, are not; the output projection's, made before it, are among the
    gradients made before, which FSDP keeps whole until the end of backward.

    ``gaps`` gets each stretch of backward between a layer's window and the next that does not follow at once (the
    target embedding's backward, between the decoder's first layer and the encoder's last), as (the index of the
    window after it; at its highest, the activations and logits alive, and the backward temporaries and all the
    parameter gradients made since the step began): the embeddings' gradients grow there, the encoder's
    activations still alive."""

    def __init__(self, device_type: str = "cpu"):
        super().__init__(device_type)
        self.windows: list[tuple[int, int, int]] = []
        self.gaps: list[tuple[int, int, int]] = []
        self._since: dict | None = None  # the open window: its layer, the gradients then, its highest, its split
        self._gap: dict | None = None  # the open gap: its highest, its split
        self._gradients_before = 0

    def __enter__(self):
        self._gradients_before = self.live_by_category.get("gradients", 0)
        return super().__enter__()

    def open(self, layer: int) -> None:
        """A layer's backward begins, as the one still open ends (that one's input is this one's output), or as
        the gap since the last one closed ends."""
        if self._since is not None:
            self._end_window()
        elif self._gap is not None:
            self.gaps.append((len(self.windows), *self._gap["split"]))
        self._gap = None
        c = self.live_by_category
        self._since = {"layer": layer, "gradients": c["gradients"], "high": self.live,
                       "split": (c["activations"] + c["logits"], c["backward"]),
                       "before": c["gradients"] - self._gradients_before}

    def close(self, layer: int) -> None:
        if self._since is not None and self._since["layer"] == layer:
            self._end_window()
            self._gap = {"high": -1}
            self._raise(self._gap, self._gradients_before)

    def _end_window(self) -> None:
        self.windows.append((*self._since["split"], self._since["before"]))
        self._since = None

    def _raise(self, stretch: dict, gradients_before: int) -> None:
        """``stretch``'s highest moment and split, if this one is higher."""
        if self.live > stretch["high"]:
            c = self.live_by_category
            stretch["high"] = self.live
            stretch["split"] = (c["activations"] + c["logits"], c["backward"] + c["gradients"] - gradients_before)

    def _grow(self, nbytes: int, category: str, into: tuple[int, ...] = ()) -> None:
        super()._grow(nbytes, category, into)
        if not into and self._since is not None:
            self._raise(self._since, self._since["gradients"])
        elif not into and self._gap is not None:
            self._raise(self._gap, self._gradients_before)


def tracked_step(trainer, micro_batches: list, device_type: str = "cpu",
                 marks: dict[str, int] | None = None, windows: list[tuple[int, int, int]] | None = None
                 ) -> TensorMemoryTracker:
    """One training step under a new tracker that starts with the model's parameters, the optimizer's state (call
    it after a first step has created Adam's moments) and DDP's gradient buckets: the tracker, with the step's peak
    and its split, and ``at_start``, the bytes live when the step began.
    ``marks`` receives the live bytes at the trainer's ledger points of the first micro-batch; ``windows``, the
    ``LayerWindows`` of its backward (hooks on the layers' inputs and outputs: module backward hooks would change
    what a checkpointed layer keeps)."""
    tracker = TensorMemoryTracker(device_type) if windows is None else LayerWindows(device_type)
    if marks is not None:
        trainer.ledger = lambda point: marks.setdefault(point, tracker.live)
    handles = []
    if windows is not None:
        layers = [*trainer.model.encoder, *trainer.model.decoder]
        hooked: dict[str, list] = {"input": [], "output": []}  # the first micro-batch's (not a recomputation's)

        def hook(end: str, tensor: torch.Tensor, on_gradient) -> None:
            if tensor.requires_grad and len(hooked[end]) < len(layers):
                hooked[end].append(tensor.register_hook(on_gradient))

        for i, layer in enumerate(layers):
            handles += [
                layer.register_forward_pre_hook(lambda _m, args, i=i: hook("input", args[0], lambda _g: tracker.close(i))),
                layer.register_forward_hook(lambda _m, _a, out, i=i: hook("output", out, lambda _g: tracker.open(i))),
            ]
    tracker.watch(trainer.model)
    tracker.track(optimizer_state(trainer.optimizer), category="optimizer")
    tracker.hold_buckets(ddp_bucket_bytes(trainer.net))
    tracker.at_start = tracker.live  # what the step starts from: parameters and optimizer state
    try:
        with tracker:
            trainer.step(micro_batches)
    finally:
        for handle in handles:
            handle.remove()
    tracker.unwatch()
    if windows is not None:
        windows += tracker.windows
    return tracker


class CudaAllocator:
    """The CUDA caching allocator's statistics for one device (what ``PeakMemory`` reads on a GPU)."""

    def __init__(self, device: torch.device):
        self.device = device

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def peak_reserved(self) -> int:
        return torch.cuda.max_memory_reserved(self.device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def record_history(self, enabled: bool) -> None:
        """Record every allocation with its stack trace (what ``dump_snapshot`` shows), or stop recording."""
        torch.cuda.memory._record_memory_history("all" if enabled else None, max_entries=100_000)

    def dump_snapshot(self, path: Path) -> None:
        torch.cuda.memory._dump_snapshot(str(path))


# How often the tensor tracker counts a step by default: on the CPU it is the only source of the peak; on CUDA it
# adds the split by category to the allocator's figures, for a Python call per operator (every 100th step).
COUNT_EVERY = {"cpu": 1, "cuda": 100}


class PeakMemory:
    """The memory ledger of a run's training steps: the tensor tracker's split by category, and on CUDA the
    allocator's statistics.

    Every step is measured on CUDA, where the allocator's figures are free: its peak (``max_memory_allocated``),
    allocated and reserved bytes and their difference, the fragmentation. The tracker counts every ``every``-th
    step (always the first, which creates the optimizer state, and under DDP the process's first two): on the CPU
    the step's peak itself, on CUDA the split of the tracked tensors at their peak beside the allocator's (which
    adds its block rounding and cuBLAS workspaces). On the CPU, given the step's micro-batch shapes
    (``step_shapes``), it also counts every step larger than those counted so far in some dimension, so that the
    run's peak is exact with every > 1: a step's allocations grow with its micro-batches' pairs and padded lengths
    (and, under chunked_ce, real target tokens), so a step no larger in any of them than a counted one (the same
    number of micro-batches, each no larger than the counted step's in the same place) peaks no higher. A counted
    step's shapes cover others only once the optimizer state exists at its start: the first step creates that
    state, so it peaks lower than a later step of its shapes. They are not kept in checkpoints: a resumed run
    (perhaps with another strategy) counts its own. Measured steps also give the growth of live memory during the first
    micro-batch's forward and backward passes (``mark``, called by ``Trainer.step``). Peaks are kept per window
    (one per log line; ``skip_window`` drops what happened outside training, such as evaluation) and for the run.
    ``allocator`` replaces CUDA's (tests).
    """

    def __init__(self, device: torch.device, track: bool = True, every: int | None = None, allocator=None):
        self.device = device
        self.allocator = allocator or (CudaAllocator(device) if device.type == "cuda" else None)
        self.tracker = TensorMemoryTracker(device.type) if track else None
        self.every = max(1, int(every or COUNT_EVERY.get(device.type, 1)))
        self.run_peak = 0
        self.run_reserved = 0
        self.run_tracked_peak = 0
        self.run_peak_by_category: dict[str, int] = {}
        self.run_max_delta: dict[str, int | None] = {"forward": None, "backward": None}  # none measured yet
        self.window_peak = 0
        self.window_sampled = False
        self.last: dict[str, float] = {}  # the ledger of the window's last measured step, in MiB
        self.last_split: dict[str, float] = {}  # the split of the window's last counted step, in MiB
        self._marks: dict[str, int] | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._recording = False
        self._ddp_steps = 0  # the steps still to count whatever ``every`` says (see measure)
        self.counted_shapes: list[tuple] = []  # the largest shapes counted (see counts), none covering another
        self._failed = False  # the last measured step raised: the allocator's peak is its (see measure)
        if self.allocator:  # a sweep's jobs share a process: this run's figures start here
            self.allocator.reset_peak()

    @property
    def available(self) -> bool:
        return self.allocator is not None or self.tracker is not None

    def watch(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, buckets: int = 0) -> None:
        """Track ``model``'s parameters and ``optimizer``'s state; ``buckets``: the bytes of DDP's gradient buckets,
        counted as gradients (the CUDA allocator sees them, the tracker does not)."""
        if self.tracker is not None:
            self.tracker.watch(model)
            self.tracker.hold_buckets(buckets)
            self._ddp_steps = 2 if buckets else 0
        self._optimizer = optimizer

    def _live(self) -> int:
        return self.allocator.allocated() if self.allocator else self.tracker.live

    def mark(self, point: str) -> None:
        """``Trainer.step``'s ledger hook: live bytes at the first micro-batch's forward start and end and its
        backward end."""
        if self._marks is not None:
            self._marks.setdefault(point, self._live())

    def counts(self, step: int, shapes: tuple | None = None) -> bool:
        """Whether the tracker counts training step ``step`` (1-based), whose micro-batches have ``shapes``
        (``step_shapes``; None: counted by step number alone, as under torchrun, where the ranks must count the
        same steps)."""
        if self.tracker is None:
            return False
        # DDP: this process's first two steps too. The first shows the tracker the storages of the gradient
        # buckets, the second frees them for new ones: uncounted, the later steps would miss the new buckets
        if (step - 1) % self.every == 0 or self._ddp_steps > 0:
            return True
        return self.allocator is None and shapes is not None and not any(_covers(c, shapes) for c in self.counted_shapes)

    @contextlib.contextmanager
    def measure(self, step: int = 1, shapes: tuple | None = None):
        """Context for training step ``step`` (1-based), giving whether the tracker counts it (``counts``):
        measured on CUDA, counted if so."""
        counted = self.counts(step, shapes)
        self._ddp_steps = max(0, self._ddp_steps - 1)
        # the optimizer state exists before the step (not created in it): its shapes may cover later steps
        covers = counted and shapes is not None and (self._optimizer is None or bool(self._optimizer.state))
        if not (self.allocator or counted):
            yield False
            return
        self._marks = {}
        if self.allocator:
            self._fold_allocator_peak()
            self.allocator.reset_peak()
        if counted:
            # the optimizer's state: created inside a counted step (the first), or loaded from a checkpoint before
            # training, outside any; storages already counted are skipped
            if self._optimizer is not None:
                self.tracker.track(optimizer_state(self._optimizer), category="optimizer")
            self.tracker.reset_peak()
        try:
            with self.tracker if counted else contextlib.nullcontext():
                yield counted
        except BaseException:
            # A step that failed (out of memory, then redone with more accumulation, or the run's end) is in no
            # figure: its peak says what did not fit, not what the run needs. On CUDA the allocator's peak holds it
            # until the next reset, which must not fold it into the window's.
            self._failed = True
            raise
        finally:
            marks, self._marks = self._marks, None
        self._record(marks, counted)
        if covers:
            self.counted_shapes = [c for c in self.counted_shapes if not _covers(shapes, c)] + [shapes]

    def _fold_allocator_peak(self) -> None:
        """The allocator's peak since its last reset into the window's, unless a failed step reached it."""
        if not self._failed:
            self.window_peak = max(self.window_peak, self.allocator.peak())
        self._failed = False

    def _record(self, marks: dict[str, int], counted: bool) -> None:
        mib = 2**20
        if self.allocator:
            a = self.allocator
            peak, reserved, allocated, now_reserved = a.peak(), a.peak_reserved(), a.allocated(), a.reserved()
            self.run_reserved = max(self.run_reserved, reserved)
            self.last = {"cuda_allocated_mb": allocated / mib, "cuda_reserved_mb": now_reserved / mib,
                         "cuda_fragmentation_mb": (now_reserved - allocated) / mib, "cuda_peak_reserved_mb": reserved / mib}
        else:
            peak, self.last = self.tracker.peak, {}
        if counted:
            self.last_split = {f"mem_{k}_mb": v / mib for k, v in self.tracker.peak_by_category.items()}
            if self.tracker.peak > self.run_tracked_peak:
                self.run_tracked_peak = self.tracker.peak
                self.run_peak_by_category = dict(self.tracker.peak_by_category)
        self.last["step_peak_mb"] = peak / mib
        if {"forward_start", "forward_end", "backward_end"} <= marks.keys():
            forward = marks["forward_end"] - marks["forward_start"]
            backward = marks["backward_end"] - marks["forward_end"]
            self.last.update(mem_forward_delta_mb=forward / mib, mem_backward_delta_mb=backward / mib)
            for phase, change in (("forward", forward), ("backward", backward)):  # backward: mostly a release
                most = self.run_max_delta[phase]
                self.run_max_delta[phase] = change if most is None else max(most, change)
        self.window_peak = max(self.window_peak, peak)
        self.window_sampled = True
        self.run_peak = max(self.run_peak, peak)

    def window_metrics(self) -> dict[str, float]:
        """The window's peak and the last measured step's ledger, in MiB (rounded); starts a new window."""
        if not self.window_sampled:
            return {}
        if self.allocator:
            self._fold_allocator_peak()
        metrics = {"peak_memory_mb": self.window_peak / 2**20, **self.last_split, **self.last}
        self.skip_window()  # the allocator's peak too: the next window's starts from what is allocated now
        return {k: round(v, 1) for k, v in metrics.items()}

    def skip_window(self) -> None:
        if self.allocator:
            self.allocator.reset_peak()
        self.window_peak, self.window_sampled, self.last, self.last_split = 0, False, {}, {}

    WINDOW_FIELDS = ("window_peak", "window_sampled", "last", "last_split")

    def window_state(self) -> dict:
        """The window's figures not yet logged, for a stop's checkpoint (Window.open_state)."""
        if self.allocator and self.window_sampled:
            self._fold_allocator_peak()
        return {k: copy.copy(getattr(self, k)) for k in self.WINDOW_FIELDS}

    RUN_FIELDS = ("run_peak", "run_reserved", "run_tracked_peak", "run_peak_by_category", "run_max_delta")

    def run_state(self) -> dict:
        """The run's peaks so far, for its checkpoints: a resumed run reports the peaks of all its parts."""
        return {k: copy.copy(getattr(self, k)) for k in self.RUN_FIELDS}

    def load_run_state(self, state: dict) -> None:
        """A checkpoint's ``run_state()``, or a stop's ``window_state()``."""
        for k, v in state.items():
            setattr(self, k, v)

    def run_peak_mb(self) -> float | None:
        """None where no step finished (a run out of memory in its first): 0 would read as measured."""
        return self.run_peak / 2**20 if self.available and self.run_peak > 0 else None

    def run_peak_split_mb(self) -> dict[str, float] | None:
        """Bytes by category at the run's largest tracked peak, in MiB."""
        if not self.run_peak_by_category:
            return None
        return {k: round(v / 2**20, 1) for k, v in self.run_peak_by_category.items()}

    def run_deltas_mb(self) -> dict[str, float] | None:
        """The largest change of live memory seen during one forward pass and during one backward pass, in MiB
        (backward's is negative where every backward pass releases more than it allocates)."""
        if not self.available:
            return None
        return {k: None if v is None else round(v / 2**20, 1) for k, v in self.run_max_delta.items()}

    def run_reserved_mb(self) -> float | None:
        return self.run_reserved / 2**20 if self.allocator else None

    def record_history(self, enabled: bool = True) -> None:
        """CUDA: record allocations and their stack traces (what ``snapshot`` shows) from a step's out-of-memory
        error until the step is redone, or fails for good with a snapshot; then stop, since recording costs time at
        every allocation, for the rest of the run and for a sweep's later jobs in the process."""
        if self.allocator is not None and enabled != self._recording:
            self.allocator.record_history(enabled)
            self._recording = enabled

    def snapshot(self, stem: Path) -> Path | None:
        """Write what memory holds now: on CUDA the allocator's snapshot (``<stem>.pickle``, viewable at
        https://pytorch.org/memory_viz), on the CPU the tracker's live and peak bytes by category (``<stem>.json``)."""
        if self.allocator is not None:
            path = stem.with_suffix(".pickle")
            self.allocator.dump_snapshot(path)
            return path
        if self.tracker is None:
            return None
        path = stem.with_suffix(".json")
        mib = {k: round(v / 2**20, 1) for k, v in self.tracker.live_by_category.items()}
        peak = {k: round(v / 2**20, 1) for k, v in self.tracker.peak_by_category.items()}
        write_json(path, {"live_mb": mib, "peak_mb": peak})
        return path


def step_shapes(micro: list, real_targets: bool = False) -> tuple:
    """What a training step's allocations grow with, per micro-batch: its pairs, source and target positions and,
    with ``real_targets`` (memory=chunked_ce, whose loss gathers the non-padding positions), its target tokens."""
    return tuple((len(b), b.src.size(1), b.tgt_in.size(1), *((b.n_tgt_tokens,) if real_targets else ())) for b in micro)


def _covers(larger: tuple, shapes: tuple) -> bool:
    """Whether a step of micro-batch ``shapes`` is no larger than one of ``larger`` in any dimension: the same
    number of micro-batches, each with no more pairs, source or target positions than ``larger``'s in its place."""
    return len(larger) == len(shapes) and all(len(small) == len(big) and all(a <= b for a, b in zip(small, big))
                                              for small, big in zip(shapes, larger))


def free_earlier_runs() -> None:
    """A sweep's jobs run one after another in one process, and the job before this one leaves its tensors (model,
    optimizer state, the activations of a step that failed) in reference cycles until Python's cycle collector
    next runs: collect them before a run starts, so that its peaks and its room on the card are its own. On CUDA
    the allocator keeps their blocks reserved; the entry points give them back once per job (``src.run.train``
    before each run, the experiment scripts before each configuration), never inside a run."""
    gc.collect()


def reset_peak_rss() -> None:
    """Start a new peak-RSS measurement, so each run of a sweep (one process) reports its own peak. The memory
    that malloc keeps after an earlier run (``keep_freed_host_memory``) goes back to the kernel first; Linux then
    resets the high-water mark on writing 5 to /proc/self/clear_refs. Elsewhere the process peak stays."""
    return_host_memory()
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def return_host_memory() -> None:
    """Hand the memory malloc holds free (``keep_freed_host_memory``: a run's peak) back to the kernel (glibc)."""
    if glibc := _glibc():
        glibc.malloc_trim(0)


def peak_rss_mb() -> float:
    """Peak resident set size since ``reset_peak_rss`` (Linux VmHWM), else of the whole process."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/self/status") as f:
            line = next(line for line in f if line.startswith("VmHWM:"))
        return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 / (1024 if sys.platform == "darwin" else 1)


_freed_host_memory_kept = False  # set once keep_freed_host_memory has applied in this process


def keep_freed_host_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse instead of handing it back to the kernel (process-wide).

    By default glibc maps each allocation above a threshold (at most 32 MiB) on its own and unmaps it when freed,
    and trims the free top of its heap. On the CPU each training step's large tensors (logits, activations and
    their gradients) then arrive as fresh pages, which the kernel faults in and zeroes one by one: a 48 MB logits
    tensor costs about 10 ms of page faults (measured) before its first use. Raising both thresholds to 1-2 GiB
    (``mallopt``, as ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` would at start-up) lets freed blocks
    be reused, as CUDA's caching allocator does on the GPU, for a higher resident peak (fragmentation: 1,102
    against 971 MB on experiments/throughput's workload). Returns whether it applied (glibc only)."""
    global _freed_host_memory_kept
    glibc = _glibc()
    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
    applied = bool(glibc and glibc.mallopt(m_mmap_threshold, 1 << 30) and glibc.mallopt(m_trim_threshold, 1 << 31))
    _freed_host_memory_kept |= applied
    return applied


def freed_host_memory_kept() -> bool:
    """Whether ``keep_freed_host_memory`` applied earlier in this process. It cannot be undone: setting the
    thresholds back to glibc's start values would also turn off glibc's own adjustment of them."""
    return _freed_host_memory_kept


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (mallopt and malloc_trim are glibc's), else None."""
    return ctypes.CDLL(None) if platform.libc_ver()[0] == "glibc" else None
