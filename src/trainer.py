"""The training step and the loop around it.

One optimizer step = one batch of sentence pairs, cut into ``accum_steps`` micro-batches. The loss is the sum of
label-smoothed cross entropy over the non-pad target tokens of the whole window, divided by that token count
(fairseq's normalization), so accumulated gradients equal those of the whole batch at once, however the
micro-batches differ in length. Dividing each micro-batch's mean by ``accum_steps`` would not.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from .data.batching import Batch
from .distributed import World, average_gradients
from .memory import MemoryStrategy, count_inputs, region
from .model import Transformer

LOSS_PIECE = 1 << 24  # logits per fp32 piece of the loss: 64 MiB (a module global: torch.compile traces it)


def _pieces(rows: int, vocab: int) -> list[slice]:
    """The row ranges of ``rows x vocab`` logits that the loss takes ``LOSS_PIECE`` logits at a time. Under
    torch.compile one range, whatever the size: Inductor can fuse the fp32 conversion into the reductions (no fp32
    copy; not measured), and a loop over a dynamic size would compile again for each size."""
    if torch.compiler.is_compiling():
        return [slice(None)]
    step = max(1, LOSS_PIECE // vocab)
    return [slice(start, start + step) for start in range(0, rows, step)]


class _LabelSmoothedLoss(torch.autograd.Function):
    """Forward as ``label_smoothed_loss`` says; backward in closed form. With ``p = softmax(logits)``, the
    gradient of a non-pad position's smoothed loss is ``p - (1 - eps) * onehot(target) - eps / V`` (and of its
    NLL, ``p - onehot(target)``): one pass over the ``tokens x vocabulary`` logits where autograd's chain of
    gather, mean and log_softmax backward makes four, each with a tensor of that size.

    What is kept for backward is the logits in their own dtype, and the fp32 arithmetic runs ``LOSS_PIECE`` logits
    at a time, so low-precision logits (autocast) never get a whole fp32 copy: under bf16 the loss holds 2 bytes
    per logit from forward to backward and 4 in backward (logits and their gradient), where saving fp32
    log-probabilities held 4 and 10. In fp32 it holds 4 and 8, as before."""

    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, pad_id: int, epsilon: float) -> tuple[Tensor, Tensor]:
        vocab = logits.size(-1)
        flat, t = logits.reshape(-1, vocab), target.reshape(-1)
        lse = flat.new_empty(flat.size(0), dtype=torch.float32)
        mean = torch.empty_like(lse)
        for rows in _pieces(flat.size(0), vocab):
            part = flat[rows].float()
            torch.logsumexp(part, dim=-1, out=lse[rows])
            torch.mean(part, dim=-1, out=mean[rows])
        nll = lse - flat.gather(-1, t.unsqueeze(-1)).squeeze(-1).float()  # -log p(target)
        smooth = lse - mean  # mean over the vocabulary of -log p
        loss = (1.0 - epsilon) * nll + epsilon * smooth
        mask = t != pad_id
        ctx.save_for_backward(flat, t)
        ctx.epsilon, ctx.pad_id, ctx.shape = epsilon, pad_id, logits.shape
        # where, not loss[mask]: shapes that do not depend on the data, so the planner can run this on fake tensors
        return torch.where(mask, loss, 0.0).sum(), torch.where(mask, nll, 0.0).sum()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss: Tensor, grad_nll: Tensor) -> tuple[Tensor, None, None, None]:
        flat, t = ctx.saved_tensors
        eps, vocab = ctx.epsilon, flat.size(-1)
        keep = (t != ctx.pad_id).float().unsqueeze(-1)
        # d/dlogits of grad_loss * loss + grad_nll * nll, per kept position:
        # (grad_loss + grad_nll) * p - grad_loss * eps / V - (grad_loss * (1 - eps) + grad_nll) * onehot
        scale, shift = keep * (grad_loss + grad_nll), keep * (-grad_loss * eps / vocab)
        at_target = keep * -(grad_loss * (1.0 - eps) + grad_nll)
        grad = torch.empty_like(flat)
        for rows in _pieces(flat.size(0), vocab):
            into = grad[rows]
            if into.dtype == torch.float32:  # computed in place in the gradient
                g = torch.softmax(flat[rows], dim=-1, out=into)
            else:  # a fp32 piece, rounded into the gradient at the end
                g = torch.softmax(flat[rows], dim=-1, dtype=torch.float32)
            torch.addcmul(shift[rows], g, scale[rows], out=g)
            g.scatter_add_(-1, t[rows].unsqueeze(-1), at_target[rows])
            if g.dtype != into.dtype:
                into.copy_(g)
        return grad.view(ctx.shape), None, None, None


def label_smoothed_loss(logits: Tensor, target: Tensor, pad_id: int, epsilon: float) -> tuple[Tensor, Tensor]:
    """Sums over non-pad positions of the label-smoothed loss and of the plain negative log-likelihood.

    The smoothed loss is ``(1 - eps) * nll + eps * mean over the vocabulary of -log p`` (PyTorch's
    ``label_smoothing``, Szegedy et al. 2016). Computed in fp32 whatever the autocast dtype."""
    return _LabelSmoothedLoss.apply(logits, target, pad_id, epsilon)


def _projected_loss(generator: nn.Module, hidden: Tensor, target: Tensor, pad_id: int, epsilon: float):
    with region("logits"):
        return label_smoothed_loss(generator(hidden), target, pad_id, epsilon)


def chunked_loss(
    generator: nn.Module, hidden: Tensor, target: Tensor, pad_id: int, epsilon: float, chunk: int
) -> tuple[Tensor, Tensor]:
    """``label_smoothed_loss(generator(hidden), target)`` without the whole logits tensor.

    Only the non-pad positions are projected, ``chunk`` of them at a time; each chunk is checkpointed, so its
    logits are freed once its loss is known and recomputed one chunk at a time in backward. Peak logits memory
    falls from ``tokens x vocabulary`` to ``chunk x vocabulary``, for one more output projection. Runs eagerly
    under ``trainer.compile`` (``Trainer.compile``)."""
    keep = (target != pad_id).flatten().nonzero().squeeze(1)  # the planner's fake nonzero keeps every position
    h, t = hidden.flatten(0, 1).index_select(0, keep), target.flatten().index_select(0, keep)
    loss = nll = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, t.numel(), chunk):
        part = checkpoint(
            _projected_loss, generator, h[start : start + chunk], t[start : start + chunk], pad_id, epsilon,
            use_reentrant=False,
        )
        loss, nll = loss + part[0], nll + part[1]
    return loss, nll


def batch_loss(
    model: Transformer, batch: Batch, pad_id: int, epsilon: float, loss_chunk: int | None = None,
    chunked=chunked_loss,
) -> tuple[Tensor, Tensor]:
    """Summed label-smoothed loss and NLL of a batch on the model's device (call under the autocast context)."""
    hidden = model.hidden(batch.src, batch.tgt_in)
    if loss_chunk:
        return chunked(model.generator, hidden, batch.tgt_out, pad_id, epsilon, loss_chunk)
    return _projected_loss(model.generator, hidden, batch.tgt_out, pad_id, epsilon)


class LossModule(nn.Module):
    """The model and its loss as one module, whose forward pass returns ``batch_loss``: what
    DistributedDataParallel wraps (its gradient hooks need the whole forward pass to go through it) and what
    ``trainer.compile`` compiles."""

    def __init__(self, model: Transformer, pad_id: int, epsilon: float, loss_chunk: int | None):
        super().__init__()
        self.model, self.pad_id, self.epsilon, self.loss_chunk = model, pad_id, epsilon, loss_chunk
        self.chunked_loss = chunked_loss

    def forward(self, src: Tensor, tgt_in: Tensor, tgt_out: Tensor) -> tuple[Tensor, Tensor]:
        with region("activations"):  # inside DDP's forward, which begins in the gradients' region (Trainer)
            return batch_loss(self.model, Batch(src, tgt_in, tgt_out, 0, 0), self.pad_id, self.epsilon,
                              self.loss_chunk, self.chunked_loss)


def inverse_sqrt_schedule(warmup_steps: int):
    """Multiplier of the peak learning rate after ``i`` optimizer steps: linear warmup to 1 at
    ``warmup_steps``, then ``sqrt(warmup_steps / step)`` (the paper's schedule, section 5.3)."""
    warmup = max(1, warmup_steps)

    def factor(i: int) -> float:
        step = i + 1
        return min(step / warmup, math.sqrt(warmup / step))

    return factor


def paper_peak_lr(d_model: int, warmup_steps: int, factor: float = 1.0) -> float:
    """The peak of ``d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)``, reached at ``step = warmup``."""
    return factor * d_model**-0.5 * max(1, warmup_steps) ** -0.5


@dataclass
class StepStats:
    loss_sum: Tensor  # label-smoothed, summed over target tokens (detached, on the device)
    nll_sum: Tensor
    n_tgt_tokens: int
    n_src_tokens: int
    n_padded: int  # source and target positions including padding
    grad_norm: Tensor
    skipped: bool = False  # fp16: the scaler found inf/NaN gradients and skipped the update
    nonfinite: bool = False  # the loss or the gradients were NaN or infinite: no update (trainer.on_nonfinite)
    flops: int = 0  # the model FLOPs of the step's forward and backward passes (ModelArgs.training_flops)
    lr: float = 0.0  # the learning rate this step's update used (the schedule has moved on to the next step's)
    n_pairs: int = 0  # sentence pairs (each side's tokens include its </s>: a pair has two tokens besides its words)


class AgreedOutOfMemoryError(torch.OutOfMemoryError):
    """Data-parallel with ``Trainer.agree_on_oom``: a rank ran out of memory in the step's forward or backward pass,
    and every rank raises this, before any gradient is averaged or update taken, so the ranks can redo the step
    together. An out-of-memory error after that point, on one rank, cannot be redone: the others are past it."""


class Trainer:
    def __init__(
        self,
        model: Transformer,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        strategy: MemoryStrategy,
        device: torch.device,
        pad_id: int,
        label_smoothing: float = 0.1,
        clip_grad_norm: float | None = 1.0,
        world: World | None = None,
        net: nn.Module | None = None,
    ):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.strategy, self.device, self.pad_id = strategy, device, pad_id
        self.label_smoothing, self.clip_grad_norm = label_smoothing, clip_grad_norm
        # fp16 gradients underflow without loss scaling; bf16 has fp32's range and needs none.
        self.scaler = torch.amp.GradScaler(device.type, enabled=strategy.amp == "fp16")
        model.checkpoint_layers = strategy.checkpoint
        # Called with "forward_start", "forward_end", "backward_end" around each micro-batch when set: how the
        # memory ledger sees the growth during forward and backward (src/memory.py, src/planner.py).
        self.ledger = None
        # Check the loss and gradient norm for NaN / inf before each update (one host sync per step), and skip the
        # update when they are not finite; the caller applies trainer.on_nonfinite.
        self.check_finite = True
        self.inject_nonfinite = False  # fault injection: the next step's loss becomes NaN
        self.inject_oom: str | None = None  # fault injection: the next step's first forward pass runs out of memory
        self.inject_oom_update: str | None = None  # fault injection: the next step's update runs out of memory
        # torchrun with memory.oom_retries set: the ranks agree on an out-of-memory error after backward (see step)
        self.agree_on_oom = False
        self.world = world or World()
        # memory=fsdp: the run passes the LossModule it sharded before building the optimizer (src/distributed.py)
        self.net: nn.Module = net or LossModule(model, pad_id, label_smoothing, strategy.loss_chunk)
        if self.world.distributed and not strategy.fsdp:
            # The model's only buffers are its sinusoidal positions, the same on every rank: no broadcast of them
            # from rank 0 before each forward pass (DDP's default), a collective per micro-batch for nothing; once
            # at construction, as DDP does with its parameters. (torch 2.13 names it forward_sync_buffers and
            # deprecates broadcast_buffers=False; older releases, such as a GPU image's, know only the latter.)
            buffers = ({"forward_sync_buffers": False}
                       if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
                       else {"broadcast_buffers": False})
            self.net = DistributedDataParallel(self.net, device_ids=[device] if device.type == "cuda" else None,
                                               **buffers)
        self.ddp = isinstance(self.net, DistributedDataParallel)

    def compile(self) -> None:
        """trainer.compile: run the forward pass and the loss through ``torch.compile`` (dynamic shapes, since
        token batches change length every step); backward and the optimizer step stay as they are. The CPU's
        tensor tracker sees eager operations only, so the run turns it off (src/run.py).

        On the CPU the vector width is set explicitly, which puts it into Inductor's FX graph cache key (torch 2.13
        leaves it out): a graph cached on a CPU of another width, or under another ``ATEN_CPU_CAPABILITY``, would
        otherwise be built for this one's, with NaN losses or kernels that overrun their buffers.

        Compiled code is dropped first (``torch.compiler.reset``): a sweep's jobs share the process, and a later
        job would otherwise run an earlier job's graphs, skipping the compilation that the earlier job's throughput
        paid for (26 s against 0.01 s for the first step of a 2+2-layer model, d_model 32, on 2 CPU cores), until
        Dynamo's recompile limit sent a job's variants back to eager mode.

        The model's float attributes (dropout rates, norm epsilons, the embedding scale, label smoothing), constant
        through a run, are traced as constants (Dynamo's ``specialize_float``): torch 2.13 made each a symbol, found
        that it could not keep them so, and traced the whole step again: 25.7-26.8 s to compile against 18.9-21.7
        (the model above, Inductor's caches off)."""
        import torch._dynamo

        torch.compiler.reset()
        torch._dynamo.config.specialize_float = True
        if self.device.type == "cpu":
            from torch._inductor import config, cpu_vec_isa

            config.cpp.simdlen = cpu_vec_isa.pick_vec_isa().bit_width()
        # memory=chunked_ce's checkpointed chunks run eagerly: Dynamo cannot trace them (an AssertionError at step 1)
        (self.net.module if self.ddp else self.net).chunked_loss = torch.compiler.disable(chunked_loss)
        self.net.compile(dynamic=True)

    def step(self, micro_batches: list[Batch], step_tgt_tokens: int | None = None, real: bool = True,
             real_parts: int | None = None) -> StepStats:
        """One optimizer step over the micro-batches of one batch.

        Data-parallel: ``step_tgt_tokens`` are the target tokens of the step's batches on all ranks, the loss's
        divisor; DDP synchronizes gradients once, during the last micro-batch's backward (FSDP reduce-scatters them
        in every micro-batch's, keeping them sharded). ``real=False`` (an
        epoch's last step with fewer batches than ranks) keeps this rank in step with a loss multiplied by 0; so
        do the micro-batches after the first ``real_parts`` (FSDP: a rank whose batch has fewer pairs than
        accum_steps repeats one, as every micro-batch's forward and backward run collectives on every rank).
        With ``agree_on_oom`` (torchrun with memory.oom_retries set), no backward synchronizes: the ranks then
        learn whether any of them ran out of memory (one host all-reduce) and either all raise
        ``torch.OutOfMemoryError``, to redo the step together, or average their gradients (``average_gradients``)."""
        model, opt, scaler = self.model, self.optimizer, self.scaler
        model.train()
        counted = micro_batches[:real_parts] if real else []
        local_tokens = sum(b.n_tgt_tokens for b in counted)
        # DDP averages the gradients over the ranks; dividing by tokens / ranks leaves the sum over all tokens
        divisor = (step_tgt_tokens or local_tokens) / (self.world.size if self.world.distributed else 1)
        agree = self.agree_on_oom and self.world.distributed
        oom = None
        try:
            loss_total, nll_total = self._forward_backward(micro_batches, divisor, len(counted), sync_last=not agree)
        except torch.OutOfMemoryError as e:
            if not agree:
                raise
            oom = str(e)  # not the error itself: its traceback holds the step's tensors
        if agree:
            if self.world.any(oom is not None):
                opt.zero_grad(set_to_none=True)
                raise AgreedOutOfMemoryError(oom or "out of memory on another rank: every rank redoes the step")
            with region("gradients"):  # its flattened buckets: one of the categories (src/memory.py)
                average_gradients(model.parameters(), self.world)
        scale_before = scaler.get_scale() if scaler.is_enabled() else None
        try:
            nonfinite, grad_norm = self._update(loss_total)
        except torch.OutOfMemoryError:  # clipping, or Adam's first step making its state
            self._forget_unscaling()
            raise
        skipped = scaler.is_enabled() and scaler.get_scale() < scale_before and not nonfinite
        opt.zero_grad(set_to_none=True)
        lr = self.lr
        if not (skipped or nonfinite):  # the schedule counts the optimizer steps actually taken
            self.scheduler.step()
        n_src = sum(b.n_src_tokens for b in counted)
        n_padded = sum(b.n_padded for b in counted)
        flops = sum(model.args.training_flops(*b.src.shape, b.tgt_out.size(1)) for b in counted)
        return StepStats(loss_total, nll_total, local_tokens, n_src, n_padded, grad_norm.detach(), skipped,
                         nonfinite, flops, lr, sum(len(b) for b in counted))

    def _update(self, loss_total: Tensor) -> tuple[bool, Tensor]:
        """Unscale (fp16), clip, check and take the optimizer step: (whether it was non-finite, the gradient norm)."""
        model, opt, scaler = self.model, self.optimizer, self.scaler
        if self.inject_oom_update:
            message, self.inject_oom_update = self.inject_oom_update, None
            raise torch.OutOfMemoryError(message)
        with region("optimizer"):
            scaler.unscale_(opt)  # clip the true gradients, not the scaled ones
            if self.clip_grad_norm:
                grad_norm = nn.utils.clip_grad_norm_(model.parameters(), self.clip_grad_norm)
            else:
                # logged, not applied: the norm clip_grad_norm_ takes, in one foreach kernel (one norm per parameter
                # was 260 kernel launches a step for model=small)
                grad_norm = nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
            nonfinite = self.check_finite and not self._finite(loss_total, grad_norm)
            if not nonfinite:
                scaler.step(opt)
            scaler.update()
        return nonfinite, grad_norm

    def _forget_unscaling(self) -> None:
        """After an out-of-memory error between ``unscale_`` and ``update``, the GradScaler takes the optimizer for
        unscaled until its next update, so the redone step's ``unscale_`` would raise a RuntimeError instead of
        backing off: the scaler is made again with the same scale and counters and no step in progress."""
        if self.scaler.is_enabled():
            state = self.scaler.state_dict()
            self.scaler = torch.amp.GradScaler(self.device.type)
            self.scaler.load_state_dict(state)

    def _finite(self, loss_total: Tensor, grad_norm: Tensor) -> bool:
        """Whether the step's loss and gradients allow its update (``trainer.on_nonfinite``), decided alike on
        every rank. fp16: the scaler skips a step whose gradients overflowed by itself, a routine event counted
        apart, so the loss alone is checked, on all ranks (one host all-reduce). Data-parallel otherwise: the
        synchronized gradients, the same on every rank (a NaN loss on one rank makes them NaN on all)."""
        if self.scaler.is_enabled():
            return not self.world.any(not bool(torch.isfinite(loss_total)))
        if self.world.distributed:
            return bool(torch.isfinite(grad_norm))
        return bool(torch.isfinite(loss_total + grad_norm))

    def _forward_backward(self, micro_batches: list[Batch], divisor: float, real_parts: int, sync_last: bool
                          ) -> tuple[Tensor, Tensor]:
        """Forward and backward of each micro-batch, gradients accumulated (those after the first ``real_parts``
        with a loss multiplied by 0); DDP synchronizes them in the last backward if ``sync_last``. Returns the
        summed loss and NLL of the real ones."""
        loss_total = torch.zeros((), device=self.device)
        nll_total = torch.zeros((), device=self.device)
        mark = self.ledger or (lambda point: None)
        for i, batch in enumerate(micro_batches):
            batch = batch.to(self.device)
            count_inputs(batch.src, batch.tgt_in, batch.tgt_out)
            last = i == len(micro_batches) - 1
            # DDP: all-reduce in the last micro-batch's backward only. FSDP reduce-scatters in every one, which
            # keeps gradients sharded between micro-batches (its point: memory) for more communication.
            no_sync = hasattr(self.net, "no_sync") and not (last and sync_last)
            with self.net.no_sync() if no_sync else contextlib.nullcontext():
                if self.inject_oom:
                    message, self.inject_oom = self.inject_oom, None
                    raise torch.OutOfMemoryError(message)
                mark("forward_start")
                # DDP's forward begins by rebuilding its gradient buckets (in the second step): gradients
                with self.strategy.autocast(self.device), region("gradients") if self.ddp else contextlib.nullcontext():
                    loss_sum, nll_sum = self.net(batch.src, batch.tgt_in, batch.tgt_out)
                if self.inject_nonfinite:
                    loss_sum, self.inject_nonfinite = loss_sum * float("nan"), False
                mark("forward_end")
                real = i < real_parts
                with region("backward"):
                    self.scaler.scale(loss_sum / divisor if real else loss_sum * 0.0).backward()
                mark("backward_end")
            if real:
                loss_total += loss_sum.detach()
                nll_total += nll_sum.detach()
        return loss_total, nll_total

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]
