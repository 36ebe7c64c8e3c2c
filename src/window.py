"""The training figures between two log lines, and the run's totals."""

from __future__ import annotations

import time

import torch

from .distributed import World


class Window:
    """Training figures between two log lines, read from the device once per window rather than per step,
    plus the run's totals. The clock runs only while training steps run: it is paused (after the GPU catches
    up) for evaluation."""

    def __init__(self, device: torch.device, world: World | None = None):
        self.device, self.world = device, world or World()
        self.total_seconds = 0.0
        self.total_src_tokens = self.total_tgt_tokens = self.total_padded = self.total_skipped = self.total_flops = 0
        self.reset()

    def reset(self) -> None:
        self.steps = self.tgt_tokens = self.src_tokens = self.padded = self.skipped = self.flops = 0
        self.loss_tokens = 0  # the target tokens of the updates taken: the loss's denominator
        self.loss = self.nll = self.grad_norm = self.lr = 0.0
        self.epoch = 0  # the epoch of the window's last step
        self.seconds = 0.0
        self._t0: float | None = None

    def resume(self) -> None:
        if self._t0 is None:
            self._t0 = time.perf_counter()

    def pause(self) -> None:
        if self._t0 is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # until here the clock saw kernel launches, not their work
            self.seconds += time.perf_counter() - self._t0
            self._t0 = None

    def add(self, stats, epoch: int = 0) -> None:
        # the work of every step, one whose update a non-finite loss skipped too: its time is on the clock
        self.tgt_tokens += stats.n_tgt_tokens
        self.src_tokens += stats.n_src_tokens
        self.padded += stats.n_padded
        self.flops += stats.flops
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

    TOTALS = ("total_seconds", "total_src_tokens", "total_tgt_tokens", "total_padded", "total_skipped", "total_flops")

    def totals(self) -> dict:
        return {k: getattr(self, k) for k in self.TOTALS}

    def load_totals(self, totals: dict) -> None:
        for k, v in totals.items():
            setattr(self, k, v)

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
            self.loss, self.nll, tgt, src, padded, flops, loss_tokens = self.world.all_sum(
                [self.loss, self.nll, self.tgt_tokens, self.src_tokens, self.padded, self.flops, self.loss_tokens],
                self.device)
            self.tgt_tokens, self.src_tokens, self.padded, self.flops = int(tgt), int(src), int(padded), int(flops)
            self.loss_tokens = int(loss_tokens)
        self.total_seconds += self.seconds
        self.total_src_tokens += self.src_tokens
        self.total_tgt_tokens += self.tgt_tokens
        self.total_padded += self.padded
        self.total_skipped += self.skipped
        self.total_flops += self.flops
        loss, nll, gn = (float(x) for x in (self.loss, self.nll, self.grad_norm))
        metrics = {
            "window_s": round(self.seconds, 4),
            "src_tokens": self.src_tokens,
            "loss": loss / self.loss_tokens,
            "nll": nll / self.loss_tokens,
            "lr": self.lr,
            "tokens_per_s": (self.src_tokens + self.tgt_tokens) / max(self.seconds, 1e-9),
            "tgt_tokens": self.tgt_tokens,
            "padding_ratio": self.padding_ratio(),
            "model_tflops": self.flops / max(self.seconds, 1e-9) / 1e12,  # model FLOP/s (ModelArgs.training_flops)
            "epoch": self.epoch,
        }
        if self.steps > self.skipped:  # the norm of the updates taken (an fp16 step the scaler skipped has none)
            metrics["grad_norm"] = gn / (self.steps - self.skipped)
        if self.skipped:
            metrics["fp16_skipped_steps"] = self.skipped
        self.reset()
        return metrics
