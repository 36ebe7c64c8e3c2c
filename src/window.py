"""The training figures between two log lines, and the run's totals."""

from __future__ import annotations

import time

import torch

from .distributed import World


class Window:
    """Training figures between two log lines, read from the device once per window rather than per step,
    plus the run's totals. The clock runs only while training steps run: it is paused (after the GPU catches
    up) for evaluation. A step that ran out of memory and was redone smaller (memory.oom_retries) is timed whole,
    its failed attempt included: the time the run spent on it.

    The steps the memory tracker counts (``PeakMemory.counts``) are timed apart: its Python call per operator
    slows them (on the CPU by 5-40%, more where a strategy runs more, smaller operators, as accum does), so
    throughput is measured over the other steps where there are any, and over all of them where every step was
    counted (then the tracker's cost is in it: ``rates``)."""

    def __init__(self, device: torch.device, world: World | None = None):
        self.device, self.world = device, world or World()
        self.total_seconds = 0.0
        self.total_src_tokens = self.total_tgt_tokens = self.total_padded = self.total_skipped = self.total_flops = 0
        self.total_counted_seconds = 0.0
        self.total_counted_tokens = self.total_counted_flops = 0
        self.reset()

    def reset(self) -> None:
        self.steps = self.tgt_tokens = self.src_tokens = self.padded = self.skipped = self.flops = self.pairs = 0
        self.loss_tokens = 0  # the target tokens of the updates taken: the loss's denominator
        self.loss = self.nll = self.grad_norm = self.lr = 0.0
        self.epoch = 0  # the epoch of the window's last step
        self.seconds = 0.0
        self.counted_seconds = 0.0  # of ``seconds``: the steps the memory tracker counted, their tokens and FLOPs
        self.counted_tokens = self.counted_flops = 0
        self._t0: float | None = None
        self._counting = False

    def resume(self, counted: bool = False) -> None:
        """Start the clock, or keep it running, for a step the memory tracker counts or does not count."""
        if self._t0 is not None and self._counting != counted:
            self.pause()  # one kind of step ends: its time so far is its own
        if self._t0 is None:
            self._t0, self._counting = time.perf_counter(), counted

    def pause(self) -> None:
        if self._t0 is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # until here the clock saw kernel launches, not their work
            elapsed = time.perf_counter() - self._t0
            self.seconds += elapsed
            self.counted_seconds += elapsed if self._counting else 0.0
            self._t0 = None

    def add(self, stats, epoch: int = 0, counted: bool = False) -> None:
        # the work of every step, one whose update a non-finite loss skipped too: its time is on the clock
        self.tgt_tokens += stats.n_tgt_tokens
        self.src_tokens += stats.n_src_tokens
        self.padded += stats.n_padded
        self.flops += stats.flops
        self.pairs += stats.n_pairs
        if counted:
            self.counted_tokens += stats.n_src_tokens + stats.n_tgt_tokens
            self.counted_flops += stats.flops
        if stats.nonfinite:  # not an update: its NaN would poison the window's means
            return
        self.steps += 1
        self.epoch = epoch
        self.loss_tokens += stats.n_tgt_tokens
        self.loss = self.loss + stats.loss_sum  # device tensors: no host sync per step
        self.nll = self.nll + stats.nll_sum
        if not stats.skipped:  # fp16's routine overflow: an infinite norm, which the scaler skipped
            self.grad_norm = self.grad_norm + stats.grad_norm
        self.skipped += stats.skipped
        self.lr = stats.lr  # the window's last update's

    TOTALS = ("total_seconds", "total_src_tokens", "total_tgt_tokens", "total_padded", "total_skipped", "total_flops",
              "total_counted_seconds", "total_counted_tokens", "total_counted_flops")

    def totals(self) -> dict:
        return {k: getattr(self, k) for k in self.TOTALS}

    def restore(self, state: dict) -> None:
        """A checkpoint's ``totals()``, or a stop's ``open_state()``."""
        for k, v in state.items():
            setattr(self, k, v)

    OPEN = ("steps", "tgt_tokens", "src_tokens", "padded", "skipped", "flops", "pairs", "loss_tokens", "loss", "nll",
            "grad_norm", "lr", "epoch", "seconds", "counted_seconds", "counted_tokens", "counted_flops")

    def open_state(self) -> dict:
        """The window not yet logged, for a stop's checkpoint (one process's: under torchrun the ranks' windows
        are summed as they are logged)."""
        self.pause()
        state = {k: getattr(self, k) for k in self.OPEN}
        return {k: float(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}  # (device sums)

    def rates(self, total: bool = False) -> tuple[float, float, bool]:
        """Tokens (source and target) per second, model FLOP/s, and whether steps the memory tracker counted are
        in them: only where it counted every step of the window (or of the run, ``total``)."""
        if total:
            tokens, flops, seconds = (self.total_src_tokens + self.total_tgt_tokens, self.total_flops,
                                      self.total_seconds)
            c_tokens, c_flops, c_seconds = self.total_counted_tokens, self.total_counted_flops, self.total_counted_seconds
        else:
            tokens, flops, seconds = self.src_tokens + self.tgt_tokens, self.flops, self.seconds
            c_tokens, c_flops, c_seconds = self.counted_tokens, self.counted_flops, self.counted_seconds
        counted = not (tokens > c_tokens and seconds > c_seconds)
        if not counted:
            tokens, flops, seconds = tokens - c_tokens, flops - c_flops, seconds - c_seconds
        return tokens / max(seconds, 1e-9), flops / max(seconds, 1e-9), counted

    def padding_ratio(self, total: bool = False) -> float:
        """Share of the source and target positions computed on that were padding."""
        real = self.total_src_tokens + self.total_tgt_tokens if total else self.src_tokens + self.tgt_tokens
        padded = self.total_padded if total else self.padded
        return 1 - real / padded if padded else 0.0

    def flush(self) -> dict:
        """The window's figures (empty if no step ran since the last flush); starts a new window."""
        self.pause()
        if not self.steps:
            return {}
        if self.world.distributed:  # the sums over the ranks (the gradient norm is the same on all of them)
            # (the ranks count the same steps: PeakMemory counts by step number alone under torchrun)
            self.loss, self.nll, tgt, src, padded, flops, loss_tokens, c_tokens, c_flops, pairs = self.world.all_sum(
                [self.loss, self.nll, self.tgt_tokens, self.src_tokens, self.padded, self.flops, self.loss_tokens,
                 self.counted_tokens, self.counted_flops, self.pairs], self.device)
            self.tgt_tokens, self.src_tokens, self.padded, self.flops = int(tgt), int(src), int(padded), int(flops)
            self.pairs = int(pairs)
            self.loss_tokens, self.counted_tokens, self.counted_flops = int(loss_tokens), int(c_tokens), int(c_flops)
        self.total_seconds += self.seconds
        self.total_src_tokens += self.src_tokens
        self.total_tgt_tokens += self.tgt_tokens
        self.total_padded += self.padded
        self.total_skipped += self.skipped
        self.total_flops += self.flops
        self.total_counted_seconds += self.counted_seconds
        self.total_counted_tokens += self.counted_tokens
        self.total_counted_flops += self.counted_flops
        loss, nll, gn = (float(x) for x in (self.loss, self.nll, self.grad_norm))
        tokens_per_s, flops_per_s, _ = self.rates()
        metrics = {
            "window_s": round(self.seconds, 4),
            "src_tokens": self.src_tokens,
            "loss": loss / self.loss_tokens,
            "nll": nll / self.loss_tokens,
            "lr": self.lr,
            "tokens_per_s": tokens_per_s,  # over the steps the memory tracker did not count, if any (rates)
            "tgt_tokens": self.tgt_tokens,
            "pairs": self.pairs,  # the sentence pairs trained (tokens less 2 x pairs: words, without each </s>)
            "padding_ratio": self.padding_ratio(),
            "model_tflops": flops_per_s / 1e12,  # model FLOP/s (ModelArgs.training_flops), as tokens_per_s
            "epoch": self.epoch,
        }
        if self.steps > self.skipped:  # the norm of the updates taken (an fp16 step the scaler skipped has none)
            metrics["grad_norm"] = gn / (self.steps - self.skipped)
        if self.skipped:
            metrics["fp16_skipped_steps"] = self.skipped
        self.reset()
        return metrics
