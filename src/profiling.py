"""``trainer.profile_from=N``: PyTorch's profiler over optimizer steps N+1 .. N+``profile_steps``.

Step N is the profiler's warm-up (traced, then dropped); put N past the first steps, whose allocations and
one-time setup are not typical. A step's logging, validation and checkpoint are part of it: keep
``trainer.eval_every`` off the profiled steps to see training alone.

It writes into the run's ``profile/`` (``profile/rank<R>/`` under torchrun):

- ``trace.json``, a Chrome trace of every operator and kernel with shapes and allocations: open it at
  https://ui.perfetto.dev (or chrome://tracing);
- ``ops.txt``, the operators ranked by their own time (CUDA time on a GPU), with call counts, input shapes
  grouped apart, estimated FLOPs of the matrix products and the memory each one allocated.

The CPU memory ledger (``trainer.track_memory``) runs inside every operator and would be timed with it:
``debug=profile`` turns it off.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from .fileio import atomic_path, write_text

log = logging.getLogger(__name__)


class StepProfiler:
    """Call ``step()`` before each optimizer step: the trace's ``ProfilerStep#N`` is optimizer step N with its
    logging, validation and checkpoint, if it has them. ``done_steps``: the steps already trained (a resumed
    run), passed over at once so that the numbers still match."""

    def __init__(self, out_dir: Path, first: int | None, steps: int, done_steps: int, device: torch.device):
        self.out_dir, self.device, self.prof = out_dir, device, None
        self.window = (first + 1, first + steps) if first is not None and steps > 0 else None
        if self.window is None:
            return
        if done_steps >= first:
            log.warning("trainer.profile_from=%d: the run resumes at step %d, past the profiler's warm-up step; "
                        "not profiled", first, done_steps)
            self.window = None
            return
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.prof = profile(
            activities=activities,
            schedule=schedule(wait=first, warmup=1, active=steps, repeat=1),  # step `first` warms it up
            on_trace_ready=self._write,
            record_shapes=True,
            profile_memory=True,
            with_flops=True,
        )
        self.prof.start()
        for _ in range(done_steps):
            self.prof.step()

    def __enter__(self) -> StepProfiler:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def step(self) -> None:
        if self.prof is not None:
            self.prof.step()

    def close(self) -> None:
        """Stop the profiler; a run that ended inside the window writes what it traced."""
        if self.prof is not None:
            self.prof.stop()
            self.prof = None

    def _write(self, prof: profile) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        with atomic_path(self.out_dir / "trace.json") as tmp:
            prof.export_chrome_trace(str(tmp))
        sort_by = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        averages = prof.key_averages()
        header = (f"optimizer steps {self.window[0]}-{self.window[1]} (totals over the steps), operators by "
                  f"{sort_by}\n\n")
        by_shape = prof.key_averages(group_by_input_shape=True).table(sort_by=sort_by, row_limit=40)
        write_text(self.out_dir / "ops.txt", f"{header}{averages.table(sort_by=sort_by, row_limit=40)}\n\n{by_shape}\n")
        top = sorted(averages, key=lambda e: getattr(e, sort_by), reverse=True)[:5]
        log.info("profiled steps %d-%d -> %s; most time in %s", *self.window, self.out_dir,
                 ", ".join(f"{e.key} {getattr(e, sort_by) / 1e3:.0f} ms" for e in top))
