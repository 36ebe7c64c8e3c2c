"""Know before you run: the peak memory of one training step, estimated without allocating it.

The estimate runs the real training step (``trainer.Trainer.step``: the same model, loss, autocast, accumulation,
checkpointing, chunked loss, clipping and Adam) on fake tensors (``torch._subclasses.FakeTensorMode``): every
operator computes its output's shape, dtype and device, and no memory is allocated. ``TensorMemoryTracker`` counts
the storages those operators would create, exactly as it does on a real CPU step, so the estimate is split into
the same categories: parameters, gradients, optimizer state, activations, logits and backward temporaries.

The batch is the worst case the settings allow: every sentence as long as the longest training sentence, so no
position is padding (the one data-dependent operator, the list of non-pad positions, is answered "all of them").
As in training, the step measured is a second one, after the first has created Adam's state. The same step's
matrix products are counted too (``flops.FlopCount``), recomputation included: what a strategy costs in work
(``Estimate.compute``: checkpoint's forward again, chunked_ce's output projection again).

CPU kernels decide the shapes here, with one exception where CUDA's differ by much: attention. With dropout on
the attention weights, the CPU runs attention as matrix products and keeps the weights and their dropout mask for
backward; CUDA runs it in a fused kernel (flash or memory-efficient attention) that keeps only its inputs, output
and log-sum-exp, and draws the dropout again from its seed in backward. Planned for ``device="cuda"``, attention
runs without dropout, in the CPU's fused kernel, which keeps the same. On CUDA, ``max_memory_allocated``
also counts cuBLAS's workspaces (``cublas_workspaces``: 65 MiB on an H200, planned as ``Estimate.workspace``)
and the allocator's rounding of each block (512 bytes), and the process needs a CUDA context (300-600 MiB outside
the allocator): ``Estimate.required_gb`` (and ``usable_bytes``) add a margin for both.

The step runs under Python dispatch modes (the fake tensors', the tracker's), under which autograd never adds two
gradients of one tensor in place, as it does without one where it holds the last reference to the first: the
tracker does not count such a sum's moment where the step without a mode would not have it (``memory._accumulated``;
before, model=base with XLM-R's tied vocabulary, amp and the chunked loss was planned 488 MiB, 15%, over). Against
an H200's ``max_memory_allocated`` the ten cases of experiments/planner are within 0.61%.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

from .data.batching import Batch
from .data.encode import seq_lengths
from .distributed import World, fully_shard_net
from .errors import ConfigError
from .flops import FlopCount
from .kernels import attention_kernels, planned_attention
from .memory import CATEGORIES, MemoryStrategy, create_optimizer_state, free_earlier_runs, tracked_step
from .model import ModelArgs, Transformer
from .trainer import LossModule, Trainer, inverse_sqrt_schedule

MiB = 2**20
GiB = 2**30


@dataclass(frozen=True)
class StepShape:
    """One optimizer step's worst-case batch: ``accum_steps`` micro-batches of ``pairs`` sentence pairs, each
    source ``src_len`` positions (with </s>) and each target ``tgt_len`` (with <s> / </s>)."""

    pairs: int
    src_len: int
    tgt_len: int
    accum_steps: int = 1


def worst_case_shapes(longest_src: int, longest_tgt: int, batch_size: int, max_tokens: int | None,
                      accum_steps: int) -> list[StepShape]:
    """The batches the data settings allow at their worst; ``longest_*`` count tokens without specials, and
    accumulation cuts a batch into ``accum_steps`` micro-batches, the largest of which is planned.

    ``batch_size`` pairs: one shape, every pair at the longest lengths. A token budget (a batch of n pairs of size
    at most s, the longer side plus one special as batching counts it, has n x s <= max_tokens) allows many
    batches, each with about ``max_tokens`` positions on its longer side. Their memory is convex in s (the
    shorter side's positions fall with s, attention's squares grow), so the worst is at an end: s the longest
    size (the most positions per sentence), or s the shorter side's longest (that side's positions most: the
    logits', where it is the target). At each, ``max_tokens // s`` pairs, and one pair more at the size that
    lets it fit, where the budget's rounding leaves more positions that way; with accumulation also the pair count
    whose largest micro-batch, rounded up, holds the most positions. That last one is ranked by positions alone, not
    by attention's squares too: a search of every (pairs, size) the budget allows found micro-batches of a few pairs
    more that need 0.1-0.4% more (2026-12-03, three made-up length and budget settings with accumulation x2),
    well within plan.overhead; without accumulation the ends were the worst."""
    src_len, tgt_len = longest_src + 1, longest_tgt + 1
    if not max_tokens:
        batches = [(batch_size, src_len, tgt_len)]
    else:
        def batch(pairs: int, size: int) -> tuple[int, int, int]:
            """``pairs`` pairs of ``size``: each side as long as the size or its longest sentence allows."""
            return pairs, min(size, src_len), min(size, tgt_len)

        ends = {size: max(1, max_tokens // size) for size in (max(src_len, tgt_len), min(src_len, tgt_len))}
        batches = []
        for size, pairs in ends.items():
            batches.append(batch(pairs, size))
            smaller = max_tokens // (pairs + 1)  # the largest size at which one pair more fits
            if (pairs + 1) * smaller > pairs * size:
                batches.append(batch(pairs + 1, smaller))
        if accum_steps > 1:
            # accumulation rounds the pairs of a micro-batch up: 3 pairs of 333 in 1,000 tokens make a micro-batch of
            # 2 (666 positions) where the ends make one of 500. The pair count whose largest micro-batch holds the
            # most positions, between the ends (and a little beyond, where rounding can still win)
            def positions(n: int) -> int:
                _, src, tgt = batch(n, max_tokens // n)
                return -(-n // accum_steps) * (src + tgt)

            fewest, most = min(ends.values()), max(ends.values())
            # (at most max_tokens pairs, of one position each: memory=auto's micro-batches of one pair ask for
            # 10**9 accumulation steps, which this range was as long as)
            pairs = max(range(fewest, min(most + accum_steps, max_tokens) + 1), key=positions)
            batches.append(batch(pairs, max_tokens // pairs))
    shapes = []
    for pairs, src, tgt in batches:
        accum = min(accum_steps, pairs)
        shapes.append(StepShape(pairs=-(-pairs // accum), src_len=src, tgt_len=tgt, accum_steps=accum))
    return list(dict.fromkeys(shapes))


@dataclass
class Estimate:
    peak_bytes: int
    by_category: dict[str, int]  # bytes of each category at the peak
    forward_delta: int  # growth of live memory during the first micro-batch's forward pass
    backward_delta: int  # growth (negative: release) during its backward pass
    parameters: int  # number of parameters
    shape: StepShape
    seconds: float  # how long the estimate took
    workspace: int = 0  # cuBLAS's workspaces, planned for CUDA: allocated beside the tensors (``cublas_workspaces``)
    # The planned step's work as ``flops.FlopCount`` counts it, recomputation included, every micro-batch at the
    # shape's size (a step of 5 pairs in 2 is planned as 3 + 3); with a mixed trainer.attention on CUDA, planned as
    # math throughout, the fused calls' scores computed again in backward are not in it (under 1%).
    flops: int = 0
    model_flops: int = 0  # the model's FLOPs of the same step (``ModelArgs.training_flops``): each product once
    # What each encoder and decoder layer's backward holds at its highest beyond what it began with, in the order
    # backward reaches them (the first micro-batch's): (activations and logits alive, backward temporaries and
    # parameter gradients made, parameter gradients made before it): ``memory.LayerWindows``
    layer_windows: tuple[tuple[int, int, int], ...] = ()
    # And each stretch of backward between two of them (the target embedding's, between the decoder's layers and the
    # encoder's): (the index of the layer window after it, activations and logits alive at its highest, backward
    # temporaries and parameter gradients made by then): ``memory.LayerWindows.gaps``
    layer_gaps: tuple[tuple[int, int, int], ...] = ()

    @property
    def compute(self) -> float:
        """The step's work against the model's FLOPs: what the strategy computes again (1.0: nothing)."""
        return self.flops / self.model_flops if self.model_flops else float("nan")

    @property
    def peak_mb(self) -> float:
        return self.peak_bytes / MiB

    @property
    def allocated_bytes(self) -> int:
        """What CUDA's ``max_memory_allocated`` should show for the step: its tensors' peak and the workspaces."""
        return self.peak_bytes + self.workspace

    def split_mb(self) -> dict[str, float]:
        return {k: round(self.by_category.get(k, 0) / MiB, 1) for k in CATEGORIES}

    def required_gb(self, overhead: float = 0.10, context_gb: float = 0.5) -> float:
        """What a card must have: the estimate and the workspaces, plus ``overhead`` for the allocator's rounding
        and fragmentation, plus the CUDA context."""
        return self.allocated_bytes * (1 + overhead) / GiB + context_gb


def usable_bytes(budget_gb: float, overhead: float = 0.10, context_gb: float = 0.5) -> float:
    """The largest estimate that fits ``budget_gb`` (memory.budget_gb): ``Estimate.required_gb`` turned around."""
    if budget_gb <= context_gb:
        raise ConfigError(f"memory.budget_gb={budget_gb}: not more than the {context_gb} GB of the CUDA context "
                          "(plan.context_gb), which the card holds beside what the run allocates; nothing fits. "
                          "Give the card's memory in GB")
    return (budget_gb - context_gb) * GiB / (1 + overhead)


class _EveryPositionIsReal(TorchDispatchMode):
    """Under fake tensors, the positions that are not padding (``nonzero`` of the target mask) are all of them:
    the planned batch has no padding."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.nonzero.default:
            x = args[0]
            return torch.empty((x.numel(), x.dim()), dtype=torch.long, device=x.device)
        return func(*args, **(kwargs or {}))


PLAN_DEVICES = ("cuda", "cpu")


def cublas_workspaces(capability_major: int | None = None) -> int:
    """The bytes CUDA's allocator holds for cuBLAS through a training step, beside its tensors: a workspace for
    each thread that multiplies (the main thread, forward and optimizer; autograd's device thread, backward), of
    ``CUBLAS_WORKSPACE_CONFIG``'s size (``:SIZE_KiB:COUNT`` pairs; PyTorch's default is 32 MiB on compute
    capability 9 and later, 8 MiB and 128 KiB before; the larger where the process has no CUDA context to ask, since
    asking would create one), and cuBLASLt's on the main thread (``CUBLASLT_WORKSPACE_SIZE`` KiB, 1 MiB by
    default). On an H200 with torch 2.11 (experiments/planner),
    a fresh process kept 32 MiB after its first product, 33 after one with a bias, 65 after its first backward,
    and every checked step's ``max_memory_allocated`` was 64-69 MiB above its tensors' peak."""
    pairs = re.findall(r":(\d+):(\d+)", os.environ.get("CUBLAS_WORKSPACE_CONFIG", ""))
    if pairs:
        size = sum(int(kib) * int(count) for kib, count in pairs) * 1024
    else:
        if capability_major is None and torch.cuda.is_initialized():  # asking would create a CUDA context
            capability_major = torch.cuda.get_device_capability()[0]
        size = 32 * MiB if capability_major is None or capability_major >= 9 else 8 * MiB + 128 * 1024
    lt = os.environ.get("CUBLASLT_WORKSPACE_SIZE", "1024")
    return 2 * size + (int(lt) if lt.isdigit() else 1024) * 1024


def check_device(device: str) -> None:
    if device not in PLAN_DEVICES:
        raise ConfigError(f"plan.device={device}: expected one of {', '.join(PLAN_DEVICES)}")


def estimate_step(args: ModelArgs, strategy: MemoryStrategy, shape: StepShape, label_smoothing: float = 0.1,
                  clip_grad_norm: float | None = 1.0, world_size: int = 1, device: str = "cpu",
                  attention=None) -> Estimate:
    """The peak memory of one training step of ``shape`` for this model and strategy, on fake tensors, as it
    runs on ``device`` (``cuda``: attention in a fused kernel, unless ``attention``, the run's trainer.attention,
    leaves a call to math: ``kernels.planned_attention``); with ``world_size`` ranks, one rank's: memory=fsdp's
    share (``shard_estimate``), or under DDP with its gradient buckets (``with_ddp_buckets``). A step planned
    before in this process is not run again (``_FAKE_STEPS``); ``seconds`` is then the look-up's."""
    check_device(device)
    started = time.perf_counter()
    # fp16 and bf16 store the same bytes; the GradScaler's own state is a few scalars (and reads them back to the
    # host, which fake tensors cannot), so the plan runs fp16 as bf16.
    # What the step reads of the strategy (the rest is batching, planning and sharding, applied here or by the
    # caller): the step run, and the key of the fake steps run before
    planned = MemoryStrategy(amp="bf16" if strategy.amp == "fp16" else strategy.amp, checkpoint=strategy.checkpoint,
                             loss_chunk=strategy.loss_chunk, fsdp=strategy.fsdp_param_dtype is not None,
                             fsdp_param_dtype=strategy.fsdp_param_dtype)
    kernels = planned_attention(attention, device, args, half=planned.amp is not None)
    if device == "cuda" and kernels != [SDPBackend.MATH]:
        # CUDA's fused attention kernels draw the attention dropout again from their seed in backward and keep
        # what the CPU's fused kernel, which runs without it, keeps: no attention weights
        args = dataclasses.replace(args, attention_dropout=0.0)
    key = (args, planned, shape, label_smoothing, clip_grad_norm, None if kernels is None else tuple(kernels))
    if key not in _FAKE_STEPS:
        _FAKE_STEPS[key] = _fake_step(args, planned, shape, label_smoothing, clip_grad_norm, kernels)
    known = _FAKE_STEPS[key]
    est = dataclasses.replace(known, by_category=dict(known.by_category), seconds=time.perf_counter() - started)
    if strategy.fsdp:
        est = shard_estimate(est, args, world_size, device, strategy.param_dtype)
    elif world_size > 1:
        est = with_ddp_buckets(est)
    return dataclasses.replace(est, workspace=cublas_workspaces()) if device == "cuda" else est


# The fake steps this process has run, by all they depend on: a sweep of plan.py over cards or budgets, and the
# jobs of a train.py sweep with memory=auto, plan the same steps again (model=base with XLM-R's vocabulary: 1.3 s
# each). ``forget_estimates`` empties it.
_FAKE_STEPS: dict[tuple, Estimate] = {}


def forget_estimates() -> None:
    _FAKE_STEPS.clear()


def _fake_step(args: ModelArgs, planned: MemoryStrategy, shape: StepShape, label_smoothing: float,
               clip_grad_norm: float | None, kernels: list[SDPBackend] | None) -> Estimate:
    """``estimate_step``'s step on fake tensors, as one process runs it, attending with ``kernels``. With
    memory.fsdp_param_dtype, as FSDP's units compute: the parameters (not the buffers) in that dtype, and each
    layer's floating inputs cast to it (``shard_estimate`` sizes the fp32 shards, their gradients and Adam's state,
    which it then holds)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), _EveryPositionIsReal(), attention_kernels(kernels):
        model = Transformer(args)
        if planned.param_dtype is not None:
            _compute_in(model, planned.param_dtype)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=True)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, inverse_sqrt_schedule(4))
        trainer = Trainer(model, optimizer, scheduler, planned, torch.device("cpu"), args.pad_id, label_smoothing,
                          clip_grad_norm)
        trainer.check_finite = False  # reading a value back to the host: fake tensors have none (a few scalars)
        # Two equal micro-batches show all accumulation does to memory (the gradients held between micro-batches);
        # more of them repeat the second one, each holding its token ids besides (a few kB the plan leaves out).
        micro = [_fake_batch(shape) for _ in range(min(shape.accum_steps, 2))]
        create_optimizer_state(optimizer)
        marks: dict[str, int] = {}
        windows: list[tuple[int, int, int]] = []
        with FlopCount() as counter:
            tracker = tracked_step(trainer, micro, marks=marks, windows=windows)
    return Estimate(
        peak_bytes=tracker.peak,
        by_category=dict(tracker.peak_by_category),
        forward_delta=marks["forward_end"] - marks["forward_start"],
        backward_delta=marks["backward_end"] - marks["forward_end"],
        parameters=sum(p.numel() for p in model.parameters()),
        shape=shape,
        seconds=0.0,  # estimate_step's to say
        # the micro-batches run are equal: the others of the step do what they did
        flops=counter.total * shape.accum_steps // len(micro),
        model_flops=args.training_flops(shape.pairs, shape.src_len, shape.tgt_len) * shape.accum_steps,
        layer_windows=tuple(windows),
        layer_gaps=tuple(tracker.gaps),
    )


def estimate_worst(args: ModelArgs, strategy: MemoryStrategy, shapes: list[StepShape], label_smoothing: float = 0.1,
                   clip_grad_norm: float | None = 1.0, world_size: int = 1, device: str = "cpu",
                   attention=None) -> Estimate:
    """The largest of the steps of ``shapes`` (``worst_case_shapes``); its ``seconds`` are all of theirs."""
    estimates = [estimate_step(args, strategy, shape, label_smoothing, clip_grad_norm, world_size, device, attention)
                 for shape in shapes]
    worst = max(estimates, key=lambda e: e.peak_bytes)
    return dataclasses.replace(worst, seconds=sum(e.seconds for e in estimates))


def with_ddp_buckets(est: Estimate) -> Estimate:
    """One rank's peak under DDP: the single-process estimate plus DDP's gradient buckets, one more fp32 copy of
    the gradients that every rank holds for the whole run (counted as gradients). On 2 CPU ranks (gloo) a model
    with 131 MB of parameters peaked 136 MB higher per rank under DDP than alone (README)."""
    buckets = 4 * est.parameters
    split = dict(est.by_category)
    split["gradients"] = split.get("gradients", 0) + buckets
    return dataclasses.replace(est, peak_bytes=est.peak_bytes + buckets, by_category=split)


def _compute_in(model: Transformer, dtype: torch.dtype) -> None:
    """A model's parameters in ``dtype``, and its layers' floating inputs cast to it as they enter: what FSDP2's
    ``MixedPrecisionPolicy(param_dtype=dtype)`` computes with (each unit's parameters gathered in ``dtype``, each
    unit's floating inputs cast), in one process."""
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.to(dtype)

    def cast(_module, args, kwargs):
        return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, (args, kwargs))

    for layer in [*model.encoder, *model.decoder]:
        layer.register_forward_pre_hook(cast, with_kwargs=True)


def shard_estimate(est: Estimate, args: ModelArgs, world_size: int, device: str = "cpu",
                   param_dtype: torch.dtype | None = None) -> Estimate:
    """One rank's share of a single-process estimate under memory=fsdp (FSDP2, one unit per layer and one for
    the rest), at the largest of the moments below. With ``param_dtype`` (memory.fsdp_param_dtype: FSDP2's
    MixedPrecisionPolicy), ``est`` is the step as the units compute (``_fake_step``: parameters in that dtype,
    each layer's input cast to it), and everything gathered is in that dtype; the shards, their gradients, the
    reduce-scatters and Adam's state stay fp32.

    In backward, at the single-process estimate's peak: parameters (not buffers), gradients and Adam's state are
    divided by the ranks. Added, as ``gathered``: the root unit's gathered parameters (embeddings, output
    projection, final norms), which stay gathered from forward to backward, and one layer's, gathered again in
    backward with its unsharded gradient before the reduce-scatter, beside the buffer of the next layer's
    all-gather, prefetched (its parameters padded to a multiple of the ranks): here the largest layer's, each.

    In the optimizer step: every gradient and Adam's state, sharded, and what Adam's step over sharded parameters
    (DTensors, which take no fused kernel) allocates: on CUDA the foreach implementation's square root of every
    ``exp_avg_sq`` shard at once, on the CPU the loop's, one parameter at a time. With a model large against its
    batch and 2 ranks, this moment is the peak. optim.weight_decay adds nothing to it on CUDA: the foreach
    implementation's copy of the gradients with the decay added, as large as its square roots, is freed before they
    are taken.

    In each layer's backward (from the second backward reaches: the first has no reduce-scatter before it): the
    root unit and that layer gathered, with the buffer of the next layer's all-gather, which FSDP prefetches as this
    one's backward begins (none after the last), the reduce-scatter of the layer before it (its input, a copy of
    that layer's gradient kept until the next one starts), the gradient shards of all the layers before it, 1/N
    each, the root unit's gradients made before it (the output projection's: FSDP keeps them whole until the root
    reduce-scatters at the end; 0.42% under without them), the sharded parameters and Adam's state, and what the
    layer's backward holds at its highest in the single-process step: the activations still alive, its backward
    temporaries (a checkpointed layer's recomputed activations among them) and its unsharded gradient
    (``Estimate.layer_windows``). Every layer is a moment of its own: with bf16 parameters a checkpointed step's
    peak is a later layer's, with more shards (one moment of the largest window with two layers' shards was 2.5%
    under, 4 ranks), and the buffer is the next layer's (one of the layer's own size was up to 2.3% over: the
    decoder's first layer is reached before the encoder's smaller last one).
    With a small batch and 4 or more ranks, which divide everything else, this moment is the peak; so it is with a
    medium one, whose single-process peak is Adam's step (model=small, 4 pairs of 32 tokens: 13.6% and 27.9% under
    with 2 and 4 ranks without the activations), and with checkpointed layers (16 pairs of 32 tokens: 4.4% and
    12.7% under without the recomputation; experiments/distributed/fsdp_peaks.py).

    Between the decoder's layers and the encoder's, in the target embedding's backward: the root unit gathered,
    the encoder's last layer gathered ahead of its backward (its all-gather's buffer freed), the decoder's
    gradients reduce-scattered as in the layer moment after it, the encoder's activations still alive, and the
    root's unsharded gradients made by then with the embedding's backward temporaries (``Estimate.layer_gaps``).
    With a target vocabulary tied to the output projection, whose gradient the embedding's adds into, under bf16
    autocast, this moment is the peak: 1.6% to 1.8% under on 2 to 8 ranks without it (fsdp_peaks.py).

    At the end of backward: the root unit's parameters still gathered, with all their unsharded gradients, which it
    reduce-scatters last, beside the layers' gradient shards and the last layer's reduce-scatter input (0.5% under
    without it), the sharded parameters and Adam's state. With a large untied vocabulary and a
    small batch, this moment is the peak (experiments/distributed/fsdp_peaks.py). Then the root resharded: its
    unsharded gradients copied into its reduce-scatter's fp32 input (with bf16 parameters, the larger moment: the
    peak with 4 ranks), and that reduce-scatter's output beside the input while the source embedding's gradient,
    the last that backward makes, is still held (the peak with 2 ranks); with bf16 parameters, a large
    vocabulary's estimate was up to 20.3% under without them.

    As forward begins: the root unit's parameters gathered, its all-gather's buffer not yet freed as the first
    layer's gathering begins (that layer's parameters and buffer), the sharded parameters and Adam's state.

    Accumulating (``shape.accum_steps`` > 1), gradients stay sharded between micro-batches (FSDP reduce-scatters in
    each backward and adds the shards), so a later micro-batch's moments hold every gradient shard already: its
    layers' backward (the reduce-scatter adding into them, rather than making two layers' shards), the end of its
    backward, and the start of its forward, which is then the peak with a large untied vocabulary and a small
    batch (without them the estimate was up to 12.7% under: experiments/distributed/fsdp_peaks.py).

    Checked against 2-rank and 4-rank runs in tests/test_distributed.py."""
    with torch.device("meta"):
        model = Transformer(args)
    size = {id(p): p.numel() * p.element_size() for p in model.parameters()}
    padded = {id(p): -(-p.size(0) // world_size) * world_size * size[id(p)] // max(p.size(0), 1)
              for p in model.parameters()}
    params = sum(size.values())
    units = [list(layer.parameters()) for layer in [*model.encoder, *model.decoder]]
    layers = [sum(size[id(p)] for p in unit) for unit in units]
    buffers = [sum(padded[id(p)] for p in unit) for unit in units]  # each layer's all-gather buffer
    root = params - sum(layers)  # embeddings, output projection, final norms
    # gathered, in the dtype the units compute in: memory.fsdp_param_dtype's, or the parameters' fp32
    ratio = 1.0 if param_dtype is None else param_dtype.itemsize / 4
    gathered = (root + max(layers, default=0) + max(buffers, default=0)) * ratio
    # forward's start: the root unit gathered, its all-gather's buffer not yet freed, and the first layer's gathering
    starting = (root + sum(padded.values()) - sum(buffers) + (layers[0] + buffers[0] if units else 0)) * ratio
    # the single-process step's fp32 parameters, gradients and Adam's state (computed in param_dtype there)
    split = {k: v / ratio if k in ("gradients", "optimizer") else v for k, v in est.by_category.items()}
    split["parameters"] = split.get("parameters", 0) + params * (1 - ratio)  # (buffers: in fp32 there too)
    optimizer = split.get("optimizer", 0)
    sharded_optimizer = optimizer / world_size
    for category, total in (("parameters", params), ("gradients", split.get("gradients", 0)),
                            ("optimizer", optimizer)):
        split[category] = split.get(category, 0) - min(total, split.get(category, 0)) * (1 - 1 / world_size)
    split["gathered"] = gathered
    shard = params / world_size
    adam_temporary = shard if device == "cuda" else max(padded.values()) / world_size
    step = {"parameters": split["parameters"], "gathered": 0, "gradients": shard,
            "optimizer": sharded_optimizer + adam_temporary, "activations": 0, "logits": 0, "backward": 0}
    held = shard if est.shape.accum_steps > 1 else 0  # every gradient shard, from the micro-batches before
    # each layer's backward but the first's, in the order backward reaches them (the decoder's, last to first,
    # then the encoder's): the layer gathered, the next one's all-gather buffer (prefetched; none after the last),
    # the reduce-scatter of the one before and the gradient shards of all before
    order = list(reversed(range(len(units))))
    prefetched = [buffers[i] for i in order[1:]] + [0]

    def behind(j: int) -> float:  # the gradients of the layers backward reached before the j-th: reduce-scattered
        return buffers[order[j - 1]] + (held or sum(buffers[i] for i in order[:j]) / world_size)

    def root_gradients(made: float, j: int) -> float:  # the root's of ``made``, the gradients made before the j-th
        return max(0.0, made - sum(layers[i] for i in order[:j]) * ratio)  # (all but the layers'): held whole

    layer_moments = [{**step, "gathered": (root + layers[order[j]] + prefetched[j]) * ratio,
                      "optimizer": sharded_optimizer, "gradients": behind(j), "activations": activations,
                      "backward": backward + root_gradients(before, j)}
                     for j, (activations, backward, before) in enumerate(est.layer_windows[1:len(order)], 1)]
    # between the decoder's layers and the encoder's, the target embedding's backward: the root's gradients made by
    # then (the output projection's, and with tied embeddings the embedding's added into it), the encoder's last
    # layer gathered ahead (its all-gather's buffer freed) and its activations alive
    gap_moments = [{**step, "gathered": (root + layers[order[j]]) * ratio, "optimizer": sharded_optimizer,
                    "gradients": behind(j), "activations": activations, "backward": root_gradients(made, j)}
                   for j, activations, made in est.layer_gaps if 0 < j < len(order)]
    # the end of backward: every layer's gradient shard, the last layer's reduce-scatter input still held
    shards = held or sum(layers) / world_size
    end = {**step, "gathered": root * ratio, "gradients": shards + (buffers[order[-1]] if order else 0),
           "optimizer": sharded_optimizer, "backward": root * ratio}
    # then the root resharded: its gradients copied into its reduce-scatter's fp32 input (the last layer's let go
    # by then), and that reduce-scatter's output beside it, while the source embedding's gradient, the last that
    # backward made, is still held
    root_padded = sum(padded.values()) - sum(buffers)
    copying = {**end, "gathered": 0, "gradients": shards + root_padded}
    reducing = {**copying, "gradients": copying["gradients"] + root_padded / world_size,
                "backward": size[id(model.src_embed.tokens.weight)] * ratio}
    forward = {**end, "gathered": starting, "gradients": held, "backward": 0}
    split = max((split, step, *layer_moments, *gap_moments, end, copying, reducing, forward),
                key=lambda moment: sum(moment.values()))
    by_category = {k: int(v) for k, v in split.items()}
    return dataclasses.replace(est, peak_bytes=sum(by_category.values()), by_category=by_category)  # the split sums


def real_step(args: ModelArgs, strategy: MemoryStrategy, shape: StepShape, device: torch.device,
              label_smoothing: float = 0.1, clip_grad_norm: float | None = 1.0, world: World | None = None,
              foreach: bool = False, weight_decay: float = 0.0) -> tuple[Trainer, list[Batch]]:
    """The trainer and micro-batches of the step that ``estimate_step`` plans, for real: the model of ``args`` on
    ``device`` (seed 0), the strategy's loss and sharding, Adam as the run builds it (or its foreach implementation,
    ``foreach``; with ``weight_decay``), and ``shape.accum_steps`` random micro-batches of ``shape`` with no padding."""
    free_earlier_runs()  # the steps measured before this one, in this process (their cached CUDA blocks: the caller's)
    torch.manual_seed(0)
    model = Transformer(args).to(device)
    net = LossModule(model, args.pad_id, label_smoothing, strategy.loss_chunk)
    if strategy.fsdp:
        fully_shard_net(net, strategy.param_dtype)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, weight_decay=weight_decay,
                                 **({"foreach": True} if foreach else {"fused": not strategy.fsdp}))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, inverse_sqrt_schedule(4))
    trainer = Trainer(model, optimizer, scheduler, strategy, device, args.pad_id, label_smoothing, clip_grad_norm,
                      world, net)

    def batch() -> Batch:
        b, s, t = shape.pairs, shape.src_len, shape.tgt_len
        src, tgt_in, tgt_out = (torch.randint(4, args.tgt_vocab, size) for size in ((b, s), (b, t), (b, t)))
        return Batch(src, tgt_in, tgt_out, b * s, b * t)

    return trainer, [batch() for _ in range(shape.accum_steps)]


def measure_step(args: ModelArgs, strategy: MemoryStrategy, shape: StepShape, device: torch.device,
                 label_smoothing: float = 0.1, clip_grad_norm: float | None = 1.0,
                 world: World | None = None, foreach: bool = False, weight_decay: float = 0.0) -> dict[str, int]:
    """What ``estimate_step`` predicts, measured: a real training step (``real_step``; the second, after Adam's
    state exists). On the CPU the tracker's peak, and ``at_start``, the bytes the step starts from (parameters and
    optimizer state); on CUDA the allocator's ``max_memory_allocated`` and ``max_memory_reserved`` during the step,
    and the tracker's peak and split of the step after it (``tracked``, ``tracked_by_category``: tensors only, no
    cuBLAS workspaces). memory=fsdp: this rank's, inside the process group of ``world``. With ``foreach``, Adam's
    foreach implementation (which memory=fsdp's sharded parameters take on CUDA, and on the CPU only when asked):
    the CUDA estimate's step, checked on a CPU."""
    trainer, micro = real_step(args, strategy, shape, device, label_smoothing, clip_grad_norm, world, foreach,
                               weight_decay)
    # Adam's state, as every step after the first has it. On CUDA a first step of the measured batch creates it and
    # warms the caching allocator; the CPU's tracker counts tensors, not a cache, so there it is created without a
    # forward and backward pass (a model=base bf16 step takes a minute on a CPU without bf16 kernels).
    if device.type == "cuda":
        trainer.step(micro)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        trainer.step(micro)
        torch.cuda.synchronize(device)
        real = {"peak": torch.cuda.max_memory_allocated(device), "reserved": torch.cuda.max_memory_reserved(device)}
        # the next step under the tracker: the same step's tensors by category, which the allocator cannot split
        tracker = tracked_step(trainer, micro, device.type)
        return real | {"tracked": tracker.peak, "tracked_by_category": dict(tracker.peak_by_category)}
    create_optimizer_state(trainer.optimizer)
    tracker = tracked_step(trainer, micro, device.type)
    return {"peak": tracker.peak, "at_start": tracker.at_start}


TINY = dict(d_model=128, n_heads=4, d_ff=512, encoder_layers=2, decoder_layers=2)
SMALL = dict(d_model=256, n_heads=4, d_ff=1024, encoder_layers=4, decoder_layers=4)
BASE = dict(d_model=512, n_heads=8, d_ff=2048, encoder_layers=6, decoder_layers=6)
XLMR_VOCAB = 250_002

# The configurations the planner is checked on (tests/test_planner.py on the CPU, experiments/planner on a GPU):
# name, model, vocabularies (source, target, shared), strategy, batch shape.
VALIDATION_CASES = [
    ("tiny spacy none", TINY, (300, 250, False), MemoryStrategy(), StepShape(16, 21, 19)),
    ("tiny xlmr chunked_ce", TINY, (XLMR_VOCAB, XLMR_VOCAB, True), MemoryStrategy(loss_chunk=16), StepShape(4, 17, 15)),
    ("small spacy amp", SMALL, (8012, 6190, False), MemoryStrategy(amp="bf16"), StepShape(8, 25, 23)),
    ("small spacy accum+checkpoint", SMALL, (8012, 6190, False), MemoryStrategy(accum_steps=2, checkpoint=True),
     StepShape(4, 25, 23, accum_steps=2)),
    ("base spacy none", BASE, (8012, 6190, False), MemoryStrategy(), StepShape(4, 17, 16)),
    ("base xlmr amp+chunked_ce", BASE, (XLMR_VOCAB, XLMR_VOCAB, True), MemoryStrategy(amp="bf16", loss_chunk=1),
     StepShape(1, 4, 2)),
    # long sentences, where attention's kept weights matter: CUDA's fused kernels keep none (plan device="cuda")
    ("small spacy amp, 200 tokens", SMALL, (8012, 6190, False), MemoryStrategy(amp="bf16"), StepShape(1, 200, 200)),
    ("base spacy none, 200 tokens", BASE, (8012, 6190, False), MemoryStrategy(), StepShape(2, 200, 200)),
]
# The README's classic case (model=base, XLM-R's vocabulary, sentences of 256 tokens), checked on a GPU only: a real
# CPU step of it takes most of a minute and 7 GB.
CLASSIC_CASES = [
    ("classic case, none", BASE, (XLMR_VOCAB, XLMR_VOCAB, True), MemoryStrategy(), StepShape(8, 256, 256)),
    ("classic case, amp", BASE, (XLMR_VOCAB, XLMR_VOCAB, True), MemoryStrategy(amp="bf16"), StepShape(16, 256, 256)),
]


def _fake_batch(shape: StepShape) -> Batch:
    """A batch of ``shape`` with uninitialized token ids (shapes are all a FakeTensorMode step reads)."""
    b, s, t = shape.pairs, shape.src_len, shape.tgt_len
    src = torch.empty((b, s), dtype=torch.long)
    tgt_in = torch.empty((b, t), dtype=torch.long)
    tgt_out = torch.empty((b, t), dtype=torch.long)
    return Batch(src, tgt_in, tgt_out, b * s, b * t)


def cost_note(strategy: MemoryStrategy) -> str:
    """What a strategy is expected to cost in speed (measured in experiments/memory_strategies and memory_sweep)."""
    notes = []
    if strategy.amp:
        notes.append("amp: faster where the device multiplies bf16/fp16 natively")
    if strategy.accum_steps > 1:
        notes.append("accum: slower once micro-batches no longer fill the device")
    if strategy.checkpoint:
        notes.append("checkpoint: each layer's forward again in backward")
    if strategy.loss_chunk:
        notes.append("chunked_ce: the output projection again in backward, padding skipped")
    if strategy.truncates:
        notes.append("truncate: cut tokens cost BLEU")
    if strategy.max_tokens:
        notes.append("tokens: less padding")
    if strategy.trim_vocab:
        notes.append("trim_vocab: pieces never seen in training cannot be read or written (they become <unk>)")
    if strategy.fsdp:
        notes.append("fsdp: parameters gathered for each layer in forward and backward, gradients reduce-scattered"
                     + (" (gathered in bf16, each layer's input rounded to it)" if strategy.fsdp_param_dtype else ""))
    return "; ".join(notes) or "baseline"


def longest_pair(split) -> tuple[int, int]:
    """The longest source and target of a split, in tokens (no specials): from the lengths PackedSequences keeps
    (a view per sentence took 3 s of each memory=auto start on 500k pairs)."""
    return max(seq_lengths(split.src)), max(seq_lengths(split.tgt))


def choose_strategy(args: ModelArgs, strategy: MemoryStrategy, longest_src: int, longest_tgt: int, batch_size: int,
                    budget_bytes: float, amp: str = "bf16", label_smoothing: float = 0.1,
                    clip_grad_norm: float | None = 1.0, device: str = "cpu", world_size: int = 1,
                    configured: Estimate | None = None, attention=None) -> tuple[MemoryStrategy, Estimate, list[dict]]:
    """The least costly strategy whose worst-case step on ``device`` needs at most ``budget_bytes``: more
    accumulation first (the effective batch stays the same), then amp with accumulation, then checkpointing with
    accumulation, then amp, checkpointing and accumulation (checkpointing alone comes before both: with small
    micro-batches amp can need more memory than fp32, its bf16 copies of the weights outweighing the activations it
    halves); within a stage, the fewest doublings of the accumulation that fit. Returns it, its estimate,
    and the settings estimated that did not fit, in that order, with the choice last. A stage that does not fit as
    configured, and not even with micro-batches of one pair, is passed over after those two estimates; a later
    stage whose micro-batches of one pair do not fit, after that one. In the stage
    that fits, the line through those two estimates (the peak is close to affine in pairs per micro-batch) predicts
    the doubling to estimate first, and its neighbours confirm it. ``configured``: the estimate of ``strategy`` as
    it is, where the caller has made it already (plan.py), used instead of estimating it again."""
    base = dataclasses.replace(strategy, auto=True)
    stages = [{}]
    if not base.amp:
        stages.append({"amp": amp})
    if not base.checkpoint:
        stages.append({"checkpoint": True})
        if not base.amp:
            stages.append({"amp": amp, "checkpoint": True})
    estimates: dict = {}

    def shapes(accum: int) -> tuple[StepShape, ...]:
        return tuple(worst_case_shapes(longest_src, longest_tgt, batch_size, base.max_tokens, accum))

    if configured is not None:
        estimates[(base.label, shapes(base.accum_steps))] = configured

    def plan(extra: dict, accum: int) -> tuple[MemoryStrategy, Estimate]:
        candidate = dataclasses.replace(base, accum_steps=accum, **extra)
        key = (candidate.label, shapes(accum))
        if key not in estimates:
            estimates[key] = estimate_worst(args, candidate, list(key[1]), label_smoothing, clip_grad_norm,
                                            world_size, device, attention)
        return candidate, estimates[key]

    one_pair = 10**9  # accumulation steps enough for micro-batches of one pair (worst_case_shapes caps them)
    tried: list[dict] = []

    def record(candidate: MemoryStrategy, est: Estimate) -> bool:
        tried.append({"strategy": candidate.label, "accum_steps": est.shape.accum_steps, "pairs": est.shape.pairs,
                      "estimate_mb": round(est.allocated_bytes / MiB, 1)})  # what the budget is compared with
        return est.allocated_bytes <= budget_bytes

    def fits(extra: dict, accum: int) -> bool:
        """Whether the setting fits (recorded as tried where it does not)."""
        candidate, est = plan(extra, accum)
        return est.allocated_bytes <= budget_bytes or record(candidate, est)

    def out_of_reach(extra: dict) -> bool:
        """Whether not even micro-batches of one pair, the stage's least memory, fit (recorded if so)."""
        smallest, least = plan(extra, one_pair)
        if least.allocated_bytes <= budget_bytes:
            return False
        record(smallest, least)
        return True

    for i, extra in enumerate(stages):
        if i > 0 and out_of_reach(extra):  # where the stage before did not fit, its least memory first
            continue
        candidate, est = plan(extra, base.accum_steps)
        if record(candidate, est):
            return candidate, est, tried
        if est.shape.pairs == 1 or (i == 0 and out_of_reach(extra)):  # no accumulation makes this stage fit
            continue
        doublings, guess = _doublings(est, plan(extra, one_pair)[1], shapes, budget_bytes)
        candidate, est = plan(extra, first_fitting(functools.partial(fits, extra), doublings, guess))
        record(candidate, est)
        return candidate, est, tried
    raise _nothing_fits(base, min((plan(extra, one_pair) for extra in stages), key=lambda planned: planned[1].peak_bytes),
                        world_size)


def _doublings(configured: Estimate, least: Estimate, shapes: Callable[[int], tuple[StepShape, ...]],
               budget_bytes: float) -> tuple[list[int], int]:
    """The accumulation steps to search within a stage, doubling from ``configured``'s (which does not fit) up to
    micro-batches of one pair (``least``, which fits), and the index of the first that the line through those two
    estimates predicts to fit: the peak is close to affine in pairs per micro-batch. ``shapes``: a setting's
    worst-case micro-batch shapes."""
    doublings, pairs = [configured.shape.accum_steps], [configured.shape.pairs]
    while pairs[-1] > 1:  # up to one pair per micro-batch
        doublings.append(doublings[-1] * 2)
        pairs.append(max(shape.pairs for shape in shapes(doublings[-1])))
    per_pair = (configured.peak_bytes - least.peak_bytes) / (configured.shape.pairs - 1)
    most_pairs = 1 + (budget_bytes - least.allocated_bytes) / per_pair if per_pair > 0 else configured.shape.pairs
    return doublings, next((j for j in range(1, len(doublings)) if pairs[j] <= most_pairs), len(doublings) - 1)


def first_fitting(fits: Callable[[int], bool], values: list[int], guess: int) -> int:
    """The first of ``values`` that ``fits``, where the first does not, the last does, and every one after one that
    fits does too: asked first of ``values[guess]``, then one step at a time towards the answer, within the bounds
    found so far. A right guess costs at most two questions: itself and the value before it."""
    lo, hi, k = 0, len(values) - 1, guess  # the last that does not fit, the first that does, as far as known
    while hi - lo > 1:
        if fits(values[k]):
            hi, k = k, k - 1
        else:
            lo, k = k, k + 1
        k = min(max(k, lo + 1), hi - 1)
    return values[hi]


def _nothing_fits(base: MemoryStrategy, smallest: tuple[MemoryStrategy, Estimate], world_size: int) -> ConfigError:
    """choose_strategy's error when no stage fits, not even with micro-batches of one pair: ``smallest`` is the
    setting that needs the least memory, with its estimate."""
    lowest, floor = smallest
    largest = [f"{cat} {mb:,.0f}" for cat, mb in sorted(floor.split_mb().items(), key=lambda kv: -kv[1])[:3] if mb > 0]
    others = [hint for hint, applied in (("memory=chunked_ce (a large vocabulary's logits)", base.loss_chunk),
                                         ("memory=trim_vocab (tokenizer=xlmr's embeddings)", base.trim_vocab),
                                         ("memory=fsdp (over several GPUs)", base.fsdp)) if not applied]
    return ConfigError(
        f"memory.budget_gb={base.budget_gb}: no setting fits; the smallest, "
        f"{dataclasses.replace(lowest, accum_steps=floor.shape.accum_steps).label} with micro-batches of one "
        f"pair, needs an estimated {floor.allocated_bytes / MiB:,.0f} MiB"
        + (f" with cuBLAS's workspaces ({floor.workspace / MiB:g} MiB)" if floor.workspace else "") + " before overheads"
        + (f" on each of {world_size} ranks" + ("" if base.fsdp else " (DDP's gradient buckets counted as gradients)")
           if world_size > 1 else "")
        + (f", most of it {', '.join(largest)} MiB" if largest else "")
        + "; memory=auto changes only accumulation, amp and checkpointing"
        + (f": see also {', '.join(others)}" if others else "")
    )
