"""memory=fsdp: each rank's tracked peak of one training step against the planner's estimate, for a batch small
against a large vocabulary (model=tiny's layers, 30,000-piece vocabularies, one pair of 4 tokens), tied and untied,
and for model=small (300-word vocabularies) with batches from 1 pair of 16 tokens to 16 pairs of 32, with and
without checkpointed layers (memory=[fsdp,checkpoint]); each in one micro-batch, then accumulated over two
(memory=[fsdp,accum] with memory.accum_steps=2: micro-batches of that size). With ``--amp bf16``, every case
under bf16 autocast (memory=[fsdp,amp,...]); adding ``--param-dtype bf16``, FSDP gathers the parameters in bf16
(memory.fsdp_param_dtype=bf16: FSDP2's MixedPrecisionPolicy).

    torchrun --nproc_per_node=2 experiments/distributed/fsdp_peaks.py   # and 4
    torchrun --nproc_per_node=2 experiments/distributed/fsdp_peaks.py --amp bf16
    torchrun --nproc_per_node=2 experiments/distributed/fsdp_peaks.py --amp bf16 --param-dtype bf16

Rank 0 prints the tracked peak and split (MiB), the estimate and split, and the estimate's error. The step is the
one after Adam's state exists (``create_optimizer_state``), as ``src.planner.measure_step`` takes it.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from src.distributed import process_group, world_from_env  # noqa: E402
from src.memory import MemoryStrategy, create_optimizer_state, tracked_step  # noqa: E402
from src.model import ModelArgs  # noqa: E402
from src.planner import SMALL, TINY, StepShape, estimate_step, real_step  # noqa: E402
from src.tokenizers import PAD  # noqa: E402


def mib(split: dict) -> dict:
    return {k: round(v / 2**20, 2) for k, v in split.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--amp", choices=["bf16"], default=None, help="autocast every case (memory=amp)")
    parser.add_argument("--param-dtype", choices=["bf16"], default=None,
                        help="with --amp bf16: FSDP gathers and computes in it (memory.fsdp_param_dtype)")
    cli = parser.parse_args()
    amp, param_dtype = cli.amp, cli.param_dtype
    world = world_from_env()
    with process_group(world, torch.device("cpu")):
        cases = []
        small = ModelArgs(src_vocab=300, tgt_vocab=300, pad_id=PAD, **SMALL)
        for accum in (1, 2):
            cases += [(f"{'tied' if tie else 'untied'} 30,000-piece vocabularies, 1 pair of 4 tokens"
                       + ", 2 micro-batches" * (accum > 1), StepShape(1, 4, 4, accum),
                       ModelArgs(src_vocab=30_000, tgt_vocab=30_000, pad_id=PAD, tie_embeddings=tie, **TINY),
                       MemoryStrategy(fsdp=True, amp=amp, fsdp_param_dtype=param_dtype, accum_steps=accum))
                      for tie in (False, True)]
            for checkpoint in (False, True):
                strategy = MemoryStrategy(fsdp=True, amp=amp, fsdp_param_dtype=param_dtype, checkpoint=checkpoint,
                                          accum_steps=accum)
                cases += [(f"model=small, {pairs} x {tokens} tokens, {strategy.label}",
                           StepShape(pairs, tokens, tokens, accum), small, strategy)
                          for pairs, tokens in ((1, 16), (2, 16), (4, 16), (4, 32), (8, 32), (16, 32))]
        for name, shape, args, strategy in cases:
            trainer, micro = real_step(args, strategy, shape, torch.device("cpu"), world=world)
            create_optimizer_state(trainer.optimizer)
            tracker = tracked_step(trainer, micro, "cpu")
            if world.rank == 0:
                est = estimate_step(args, strategy, shape, world_size=world.size)
                print(f"{world.size} ranks, {name}: tracked {tracker.peak / 2**20:.2f} MiB "
                      f"{mib(tracker.peak_by_category)}")
                print(f"  estimate {est.peak_bytes / 2**20:.2f} MiB {mib(est.by_category)} "
                      f"({100 * (est.peak_bytes - tracker.peak) / tracker.peak:+.1f}%)", flush=True)


if __name__ == "__main__":
    main()
