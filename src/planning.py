"""The planner (src/planner.py) applied to a resolved config: ``plan_config`` for plan.py, ``choose_for_budget``
for a run's memory=auto once its data is read."""

from __future__ import annotations

import dataclasses

import torch
from torch.nn.attention import SDPBackend

from . import planner
from .building import encoded_model_args, model_args
from .data.batching import check_token_budget
from .data.encode import EncodedCorpus, EncodedSplit
from .data.prepare import prepare_data
from .errors import ConfigError, DataError
from .kernels import attention_names, deterministic_algorithms, planned_attention, shown
from .memory import MemoryStrategy, half_precision, memory_strategy
from .settings import check_settings

# the four sizes that, all given, make plan.py plan without reading the data
PLAN_SIZES = ("src_len", "tgt_len", "src_vocab", "tgt_vocab")


def sizes_given(plan) -> bool:
    """Whether the plan group (a dict or Hydra's DictConfig) gives all of PLAN_SIZES: then no data is read."""
    return all((plan or {}).get(key) for key in PLAN_SIZES)


def choose_for_budget(conf: dict, strategy: MemoryStrategy, encoded: EncodedCorpus, train_split: EncodedSplit,
                      device: torch.device, world_size: int = 1) -> tuple[MemoryStrategy, dict]:
    """memory=auto: the planner's choice for ``memory.budget_gb`` on this data (src/planner.py), for one of this
    run's ``world_size`` ranks (under DDP with its gradient buckets, under memory=fsdp its share)."""
    budget = usable_budget(conf, strategy, device.type)
    args = encoded_model_args(conf["model"], encoded)
    longest_src, longest_tgt = planner.longest_pair(train_split)
    chosen, est, tried = planner.choose_strategy(
        args, strategy, longest_src, longest_tgt, conf["data"]["batch_size"], budget, half_precision(device),
        conf["optim"]["label_smoothing"], conf["optim"]["clip_grad_norm"],
        device=device.type, world_size=world_size, attention=conf["trainer"].get("attention"),
    )
    return chosen, {
        "budget_gb": strategy.budget_gb, "usable_mb": round(budget / planner.MiB, 1), "chosen": chosen.label,
        "accum_steps": chosen.accum_steps, "amp": chosen.amp, "checkpoint": chosen.checkpoint,
        "estimate_mb": round(est.allocated_bytes / planner.MiB, 1), "worst_case": dataclasses.asdict(est.shape),
        "compute": round(est.compute, 3),  # the step's work against the model's FLOPs (checkpoint's: about 1.3)
        "tried": tried,
    }


def usable_budget(conf: dict, strategy: MemoryStrategy, device: str) -> float:
    """The bytes memory=auto's step may take on ``device`` (cuda or cpu): memory.budget_gb less plan.overhead and,
    on a GPU, the CUDA context (plan.context_gb)."""
    plan = conf.get("plan") or {}
    return planner.usable_bytes(strategy.budget_gb, plan.get("overhead", 0.10), context_gb({**plan, "device": device}))


def context_gb(plan: dict) -> float:
    """The CUDA context a card needs beside the allocator's memory (``plan.context_gb``); none planned for the
    CPU (``plan.device=cpu``), as a CPU run's memory=auto counts none."""
    return plan.get("context_gb", 0.5) if plan.get("device", "cuda") == "cuda" else 0.0


def plan_config(conf: dict, configured: planner.Estimate | None = None) -> tuple[MemoryStrategy, planner.Estimate, dict]:
    """plan.py: the estimated peak of one worst-case training step of a resolved config. Lengths and vocabulary
    sizes come from ``plan.*`` when given, else from the training data exactly as training prepares it (cached;
    nothing is allocated for the model). With memory=auto, the strategy it would choose for memory.budget_gb;
    ``configured`` is the estimate already made of the same config without memory=auto, which it starts from."""
    strategy = memory_strategy(conf["memory"], conf["data"].get("max_tokens"))
    plan = conf.get("plan") or {}
    device = plan.get("device", "cuda")
    check_settings(conf)  # before the data is read
    if strategy.fsdp and plan.get("world_size") == 1:
        raise ConfigError("plan.world_size=1: memory=fsdp shards over 2 or more ranks (training refuses one); "
                          "plan one process without memory=fsdp")
    src_len, tgt_len, src_vocab, tgt_vocab, shared = step_sizes(conf, strategy, plan)
    args = model_args(conf["model"], src_vocab, tgt_vocab, shared, pad_id=1)  # any id: the estimate does not use it
    ls, clip = conf["optim"]["label_smoothing"], conf["optim"]["clip_grad_norm"]
    info = {"src_len": src_len, "tgt_len": tgt_len, "src_vocab": src_vocab, "tgt_vocab": tgt_vocab,
            "from_data": sorted(k for k in PLAN_SIZES if not plan.get(k)), "device": device}
    world_size = plan.get("world_size") or (2 if strategy.fsdp else 1)
    if world_size > 1:
        info["world_size"] = world_size
    # as the run: trainer.deterministic decides whether cuDNN's attention runs (kernels.cuda_kernel), and its
    # CUBLAS_WORKSPACE_CONFIG cuBLAS's workspaces
    attention = conf["trainer"].get("attention")
    with deterministic_algorithms(conf["trainer"]["deterministic"]):
        if strategy.auto:
            budget = usable_budget(conf, strategy, device)
            strategy, est, info["tried"] = planner.choose_strategy(args, strategy, src_len, tgt_len,
                                                                   conf["data"]["batch_size"], budget, "bf16", ls,
                                                                   clip, device, world_size, configured, attention)
        else:
            shapes = planner.worst_case_shapes(src_len, tgt_len, conf["data"]["batch_size"], strategy.max_tokens,
                                               strategy.accum_steps)
            est = planner.estimate_worst(args, strategy, shapes, ls, clip, world_size, device, attention)
        if attention is not None:  # what plan.py says it planned: the setting, and on CUDA the kernel it runs
            kernels = planned_attention(attention, device, args, half=strategy.amp is not None)
            info["attention"] = {"setting": shown(attention_names(attention)),
                                 "math": device == "cuda" and kernels == [SDPBackend.MATH]}
    return strategy, est, info


def step_sizes(conf: dict, strategy: MemoryStrategy, plan: dict) -> tuple[int, int, int, int, bool]:
    """The longest source and target a step holds and the two vocabularies' sizes, and whether the vocabulary is
    one for both sides: from ``plan.*`` where given, else from the training data as training prepares it; the
    lengths cut as memory=truncate cuts them, and checked against the model's positions and the token budget."""
    shared = conf["tokenizer"]["name"] == "xlmr"  # one vocabulary for both sides
    measured: dict = {}
    if not sizes_given(plan):
        try:
            _, encoded, train_split, _ = prepare_data(conf, strategy, download_ok=False)
        except DataError as e:
            raise DataError(f"{e} (or give plan.src_len, plan.tgt_len, plan.src_vocab and plan.tgt_vocab)") from None
        sizes = (*planner.longest_pair(train_split), len(encoded.src_codec), len(encoded.tgt_codec))
        measured = dict(zip(PLAN_SIZES, sizes))
        shared = encoded.src_codec is encoded.tgt_codec
    src_len, tgt_len, src_vocab, tgt_vocab = (plan.get(k) or measured[k] for k in PLAN_SIZES)
    if shared and src_vocab != tgt_vocab:  # (given: measured, the one vocabulary has one size)
        raise ConfigError(f"plan.src_vocab={src_vocab}, plan.tgt_vocab={tgt_vocab}: tokenizer=xlmr has one vocabulary "
                          "for both sides; give its size to both")
    if strategy.max_src_len:
        src_len = min(src_len, strategy.max_src_len)
    if strategy.max_tgt_len:
        tgt_len = min(tgt_len, strategy.max_tgt_len)
    limit = conf["model"].get("max_positions")
    for side, n in (("src", src_len), ("tgt", tgt_len)):  # (lengths measured on the data were checked there)
        if limit is not None and n + 1 > limit:
            raise ConfigError(f"plan.{side}_len={n}: {n + 1:,} positions with the special token, above "
                              f"model.max_positions={limit}, which training refuses; cut such sentences with "
                              f"memory=truncate memory.max_{side}_len=..., or raise model.max_positions")
    if strategy.max_tokens:  # a budget that cannot hold the longest pair fails in training: say so here
        try:
            check_token_budget(strategy.max_tokens, max(src_len, tgt_len) + 1)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return src_len, tgt_len, src_vocab, tgt_vocab, shared
