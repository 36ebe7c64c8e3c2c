"""The model and its optimizer from the config's ``model`` and ``optim`` groups and the encoded corpus's
vocabularies; the seed that makes them the same in every run of the config."""

from __future__ import annotations

import random

import torch

from .data.encode import EncodedCorpus
from .errors import ConfigError
from .model import ModelArgs, Transformer
from .trainer import inverse_sqrt_schedule, paper_peak_lr


def build_model(model: dict, encoded: EncodedCorpus) -> Transformer:
    src, tgt = encoded.src_codec, encoded.tgt_codec
    if (src.pad_id, src.eos_id) != (tgt.pad_id, tgt.eos_id):  # batches end and pad sources with the target's ids
        raise ConfigError("source and target tokenizers must share the padding and end-of-sentence ids")
    return Transformer(encoded_model_args(model, encoded))


def encoded_model_args(model: dict, encoded: EncodedCorpus) -> ModelArgs:
    """The model group's settings for the encoded corpus's vocabularies (one shared, or one per side)."""
    src, tgt = encoded.src_codec, encoded.tgt_codec
    return model_args(model, len(src), len(tgt), src is tgt, tgt.pad_id)


def count_parameters(model: dict, encoded: EncodedCorpus) -> int:
    """Parameters of the configured model for these vocabularies, built on the meta device (no memory)."""
    with torch.device("meta"):
        return build_model(model, encoded).num_parameters()


def build_optimizer(model: Transformer, optim: dict, device: torch.device, fused: bool = True):
    warmup = optim["warmup_steps"]
    peak = optim.get("lr") or paper_peak_lr(model.args.d_model, warmup, optim.get("lr_factor", 1.0))
    optimizer = torch.optim.Adam(
        model.parameters(),
        lr=peak,
        betas=tuple(optim["betas"]),
        eps=optim["eps"],
        weight_decay=optim.get("weight_decay", 0.0),
        # One fused kernel for all parameters (CUDA and CPU have it; on 2 CPU cores it is 4x faster than the
        # default loop for model=small).
        # FSDP's sharded parameters (DTensors) take the foreach implementation.
        fused=(fused and device.type in ("cuda", "cpu")) or None,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, inverse_sqrt_schedule(warmup))
    return optimizer, scheduler, peak


def model_args(model: dict, src_vocab: int, tgt_vocab: int, shared: bool, pad_id: int) -> ModelArgs:
    """The model group's settings (checked by ``check_settings`` before the data is read) and the vocabularies."""
    fields = {k: v for k, v in model.items() if k != "name"}
    try:
        return ModelArgs(src_vocab=src_vocab, tgt_vocab=tgt_vocab, pad_id=pad_id, share_vocab=shared, **fields)
    except TypeError as e:
        raise ConfigError(f"model: {e}") from None



def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def rank_seed(seed: int, rank: int) -> int:
    """The seed of a torchrun rank's random streams (its dropout masks) once the model is built: the run's on rank
    0, and on another rank one drawn from (seed, rank). ``seed + rank`` gave rank 1 of seed 1 the masks of rank 0
    of seed 2, so the runs of a sweep over consecutive seeds shared streams."""
    return seed if rank == 0 else random.Random(f"{seed}/rank {rank}").getrandbits(63)

