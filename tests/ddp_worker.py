"""Run by tests/test_distributed.py under torchrun (gloo, CPU): data-parallel steps of the project's Trainer.

    torchrun --nproc_per_node=2 tests/ddp_worker.py OUT_DIR CASE [CASE ...]

CASE: ACCUM_STEPS or ACCUM_STEPS:agree (below), fsdp-peak or fsdp-plan (``fsdp_peak``) or main-first
(``main_first``), one after the other in one process group: one launch instead of one per case (each launch
imports torch twice, seconds on 2 cores).

Three batches of the test split make two optimizer steps (the second has one batch for two ranks, so rank 1
runs the dummy batch). Each rank writes its parameters after the steps, the number of DDP communication-hook
calls in each step, the number of buffer broadcasts in all steps, and its out-of-memory back-offs and gradient
averagings to OUT_DIR/rank<r>_<case>.pt. With ``agree`` (Trainer.agree_on_oom, as memory.oom_retries sets under torchrun),
rank 1 runs out of memory in step 1, and every rank redoes the step with twice the micro-batches, as src/run.py
does.
"""

import gc
import os
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook  # noqa: E402

from src.data.batching import micro_batches, pair_sizes  # noqa: E402
from src.distributed import RankSteps, process_group, world_from_env  # noqa: E402
from src.memory import MemoryStrategy  # noqa: E402
from tests.helpers import BOS, EOS, PAD, make_split, model_and_trainer  # noqa: E402

ORDER = [[0, 1, 2, 3], [4, 5, 6, 7], [0, 2, 4, 6]]  # the epoch's batches: two steps on two ranks


def main(out: Path, cases: list[str]) -> None:
    """Each case, the ``ACCUM`` and ``ACCUM:agree`` ones from the same start."""
    import src.trainer

    world = world_from_env()
    counts = {"averagings": 0, "broadcasts": 0}
    average, broadcast = src.trainer.average_gradients, dist._broadcast_coalesced

    def counting_average(*args, **kwargs):
        counts["averagings"] += 1
        return average(*args, **kwargs)

    def counting_broadcast(*args, **kwargs):  # DDP broadcasts the module's buffers before a forward when asked to
        counts["broadcasts"] += 1
        return broadcast(*args, **kwargs)

    src.trainer.average_gradients, dist._broadcast_coalesced = counting_average, counting_broadcast
    with process_group(world, torch.device("cpu")):
        for case in cases:
            if case in OTHER_CASES:
                OTHER_CASES[case](out, world)
                continue
            accum, _, agree = case.partition(":")
            result = run_case(world, int(accum), agree == "agree", counts)
            torch.save({**result, "buffer_broadcasts": counts["broadcasts"], "averagings": counts["averagings"]},
                       out / f"rank{world.rank}_{case.replace(':', '_')}.pt")


def run_case(world, accum: int, agree: bool, counts: dict) -> dict:
    split = make_split()
    sizes = pair_sizes(split)
    model, trainer = model_and_trainer(MemoryStrategy(accum_steps=accum), world=world)
    counts.update(averagings=0, broadcasts=0)  # counted from the first step: wrapping in DDP broadcasts rank 0's state
    trainer.agree_on_oom = agree
    calls: list[int] = []

    def counting_hook(state, bucket):
        calls[-1] += 1
        return allreduce_hook(None, bucket)

    trainer.net.register_comm_hook(None, counting_hook)
    backoffs, parts = 0, accum
    for step, (indices, real, group) in enumerate(RankSteps(ORDER, world), 1):
        calls.append(0)
        step_tokens = sum(len(split.tgt[i]) + 1 for b in group for i in b)
        if agree and step == 1 and world.rank == 1:
            trainer.inject_oom = "CUDA out of memory (injected on rank 1)"
        while True:
            try:
                trainer.step(micro_batches(split, indices, sizes, parts, PAD, BOS, EOS), step_tokens, real)
                break
            except torch.OutOfMemoryError:
                model.zero_grad(set_to_none=True)
                backoffs, parts = backoffs + 1, parts * 2
    return {"params": [p.detach().clone() for p in model.parameters()], "hook_calls": calls, "backoffs": backoffs}


def peak_models() -> tuple:
    """``fsdp_peak``'s models, which tests/test_distributed.py plans: model=tiny's layers with the validation
    case's vocabularies and with untied 30,000-piece ones (a batch small against its vocabulary), and model=small
    with 300-word ones (a model large against its batch)."""
    from src.model import ModelArgs
    from src.planner import SMALL, TINY

    return (ModelArgs(src_vocab=300, tgt_vocab=250, pad_id=PAD, **TINY),
            ModelArgs(src_vocab=30_000, tgt_vocab=30_000, pad_id=PAD, tie_embeddings=False, **TINY),
            ModelArgs(src_vocab=300, tgt_vocab=300, pad_id=PAD, **SMALL))


def peak_cases(ledger: bool = True) -> dict[str, tuple]:
    """``fsdp_peak``'s steps, each measured on every rank and planned by tests/test_distributed.py for one: name ->
    (model args, strategy, shape, ``measure_step``'s keywords). Without ``ledger`` (the 4-rank test) only
    ``FOUR_RANKS``' steps (seconds each, in a 4-rank launch on 2 cores)."""
    from src.planner import StepShape

    args, vocab, small = peak_models()
    fsdp, accum = MemoryStrategy(fsdp=True), MemoryStrategy(fsdp=True, accum_steps=2)
    bf16 = MemoryStrategy(fsdp=True, amp="bf16", fsdp_param_dtype="bf16")
    cases = {
        # the validation case's model and batch, under memory=fsdp and under DDP
        "fsdp": (args, fsdp, StepShape(16, 21, 19), {}),
        "ddp": (args, MemoryStrategy(), StepShape(16, 21, 19), {}),
        # a batch small against a large untied vocabulary, whose peak is the end of backward
        "fsdp_vocab": (vocab, fsdp, StepShape(1, 4, 4), {}),
        # accumulating, whose later micro-batch's peak is its forward's start: every gradient shard held already
        "fsdp_vocab_accum": (vocab, accum, StepShape(1, 4, 4, 2), {}),
        # the target vocabulary tied to the output projection, under bf16 autocast: the peak is the target
        # embedding's backward, between the decoder's layers and the encoder's, its gradient added into theirs
        "fsdp_tied_amp": (replace(vocab, tie_embeddings=True), replace(fsdp, amp="bf16"), StepShape(1, 4, 4), {}),
        # a medium batch, whose peak is a layer's backward with the activations still alive then, and a larger one
        # with checkpointed layers, whose peak is a layer's backward with its recomputed activations
        "fsdp_medium": (small, fsdp, StepShape(4, 32, 32), {}),
        "fsdp_checkpoint": (small, replace(fsdp, checkpoint=True), StepShape(16, 32, 32), {}),
        # bf16 autocast over checkpointed layers, whose casts of the gathered weights autocast's cache kept through
        # forward (src/model.py's uncached_autocast): forward's end was the peak with 4 ranks
        "fsdp_amp_checkpoint": (small, MemoryStrategy(fsdp=True, amp="bf16", checkpoint=True), StepShape(1, 16, 16),
                                {}),
        # memory.fsdp_param_dtype=bf16 (FSDP2's MixedPrecisionPolicy): the same step as the one above, and a large
        # untied vocabulary's, whose root unit reduce-scatters in fp32 the gradients it computed in bf16
        "fsdp_bf16_checkpoint": (small, replace(bf16, checkpoint=True), StepShape(1, 16, 16), {}),
        "fsdp_bf16_vocab": (vocab, bf16, StepShape(1, 4, 4), {}),
        # accumulating: a later micro-batch's layer's backward, every gradient shard held already
        "fsdp_accum": (small, accum, StepShape(1, 16, 16, 2), {}),
        # a model large against its batch, whose peak is Adam's step with 2 ranks (a layer's backward with 4), as
        # FSDP takes it on CUDA (foreach); with weight decay, Adam's grad + wd * param
        "fsdp_step": (small, fsdp, StepShape(1, 4, 4), {"foreach": True}),
        "fsdp_step_decay": (small, fsdp, StepShape(1, 4, 4), {"foreach": True, "weight_decay": 0.01}),
    }
    return cases if ledger else {name: cases[name] for name in FOUR_RANKS}


# The steps the 4-rank test measures: the validation case, and those whose peak with 4 ranks is another moment than
# with 2 or was until a fix (a layer's backward, not Adam's step; a large vocabulary's end of backward, bf16
# parameters' reduce-scatter input, not its output; autocast over checkpointed layers, forward's end). The 2-rank
# tests measure every step, and experiments/distributed/fsdp_peaks.py every step with 2, 4 and 8 ranks.
FOUR_RANKS = ("fsdp", "fsdp_vocab", "fsdp_amp_checkpoint", "fsdp_bf16_vocab", "fsdp_step")


def fsdp_peak(out: Path, world, ledger: bool = True) -> None:
    """The planner's and the ledger's checks (on 2 or 4 ranks): each rank's tracked peak of every one of
    ``peak_cases``' real training steps, against what src/planner.py estimates for one rank, and with ``ledger``
    (the 2-rank tests) the split of three steps under memory=fsdp and under DDP."""
    from src.memory import tracked_step
    from src.planner import measure_step, real_step

    cpu, cases = torch.device("cpu"), peak_cases(ledger)
    peaks = {}
    for name, (args, strategy, shape, keywords) in cases.items():
        gc.collect()  # what is alive between the steps (torch, the process group) kept out of each step's own
        gc.freeze()  # collection (real_step's free_earlier_runs): as tests/conftest.py does between tests
        peaks[name] = measure_step(args, strategy, shape, cpu, world=world, **keywords)
    # the ledger's split of a run's first three steps, each under a new tracker, as a run samples them
    args, _, shape, _ = cases["fsdp"]
    for name, fsdp in (("fsdp_steps", True), ("ddp_steps", False)) if ledger else ():
        trainer, micro = real_step(args, MemoryStrategy(fsdp=fsdp), shape, cpu, world=world)
        peaks[name] = [dict(tracked_step(trainer, micro).peak_by_category) for _ in range(3)]
    torch.save(peaks, out / f"fsdp_peak{world.rank}.pt")


def main_first(out: Path, world) -> None:
    """A corpus prepared as src/data/prepare.py prepares it under torchrun, into an empty cache (OUT_DIR/cache): whether
    each rank tokenized it or loaded it."""
    from omegaconf import OmegaConf

    from src.data.prepare import prepare_data
    from tests.conftest import compose_config

    cfg = compose_config("data.train_size=200", run_dir=out / "run", cache_dir=out / "cache")
    conf = OmegaConf.to_container(cfg, resolve=True)
    _, encoded, _, _ = prepare_data(conf, MemoryStrategy(), world=world)
    torch.save({"from_cache": encoded.from_cache}, out / f"main_first{world.rank}.pt")


OTHER_CASES = {"fsdp-peak": fsdp_peak, "fsdp-plan": partial(fsdp_peak, ledger=False), "main-first": main_first}


def exit_without_interpreter_shutdown() -> None:
    """Every backward pass stashes a Python object in the thread's state (torch/autograd/graph.py,
    ``_engine_run_backward``); each gloo collective that DDP or FSDP starts in it keeps a copy, which gloo's worker
    thread releases when the collective is done, taking the GIL. A worker exits a few milliseconds after its last
    backward: if gloo's thread is still that late, Python (shutting down) ends it inside a C++ destructor and the
    process aborts ("terminate called without an active exception"; 1 run in about 400 here, 1 in 6 with gloo's
    threads starved of CPU; seen in CI). The results are written and closed by now, so the worker leaves at once.
    (train.py does seconds of work, evaluation and checkpoints, between its last backward and its exit.)"""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
    exit_without_interpreter_shutdown()
