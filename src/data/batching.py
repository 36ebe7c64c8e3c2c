"""From encoded sentences to padded batches.

A batch holds ``batch_size`` sentence pairs (the sentences of one optimizer step). Within a shuffled pool of
``pool_batches`` batches, sentences are sorted by length before they are cut into batches, so batches carry little
padding but their order stays random (torchtext's BucketIterator, fairseq's length ordering).
Gradient accumulation cuts a batch into micro-batches of neighbouring lengths, each padded on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .encode import EncodedSplit


@dataclass
class Batch:
    src: Tensor  # (B, S): source ids, then </s>, right-padded
    tgt_in: Tensor  # (B, T): <s>, then target ids (decoder input)
    tgt_out: Tensor  # (B, T): target ids, then </s> (labels; padding is ignored by the loss)
    n_src_tokens: int  # non-pad tokens
    n_tgt_tokens: int

    def __len__(self) -> int:
        return self.src.size(0)

    def to(self, device: torch.device) -> Batch:
        nb = device.type == "cuda"
        return Batch(
            self.src.to(device, non_blocking=nb),
            self.tgt_in.to(device, non_blocking=nb),
            self.tgt_out.to(device, non_blocking=nb),
            self.n_src_tokens,
            self.n_tgt_tokens,
        )


def pad_stack(seqs: list[Tensor], pad_id: int) -> Tensor:
    return torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=pad_id)


def collate(src: list[Tensor], tgt: list[Tensor], pad_id: int, bos_id: int, eos_id: int) -> Batch:
    eos, bos = torch.tensor([eos_id]), torch.tensor([bos_id])
    src_seqs = [torch.cat([s, eos]) for s in src]
    tgt_in = [torch.cat([bos, t]) for t in tgt]
    tgt_out = [torch.cat([t, eos]) for t in tgt]
    pin = torch.cuda.is_available()  # page-locked host memory lets the copy to the GPU overlap compute
    tensors = [pad_stack(x, pad_id) for x in (src_seqs, tgt_in, tgt_out)]
    if pin:
        tensors = [t.pin_memory() for t in tensors]
    return Batch(*tensors, sum(len(s) for s in src_seqs), sum(len(t) for t in tgt_out))


def pair_sizes(split: EncodedSplit) -> list[int]:
    """The padded size a pair costs: the longer of its source and target (each with one special token)."""
    return [max(len(s), len(t)) + 1 for s, t in zip(split.src, split.tgt)]


def batch_indices(
    sizes: list[int], batch_size: int, shuffle: bool, seed: int = 0, epoch: int = 0, pool_batches: int = 100
) -> list[list[int]]:
    """Sentence indices of each batch for one epoch; every index appears exactly once.

    With ``shuffle``, the order is a function of ``(seed, epoch)`` alone, so a run is reproducible."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    n = len(sizes)
    if shuffle:
        g = torch.Generator().manual_seed(seed * 100_003 + epoch)
        order = torch.randperm(n, generator=g).tolist()
    else:
        order = list(range(n))
    pool = batch_size * pool_batches
    batches = []
    for start in range(0, n, pool):
        chunk = sorted(order[start : start + pool], key=lambda i: sizes[i])
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    if shuffle:
        perm = torch.randperm(len(batches), generator=g).tolist()
        batches = [batches[i] for i in perm]
    return batches


def split_batch(indices: list[int], sizes: list[int], parts: int) -> list[list[int]]:
    """Cut one batch into ``parts`` micro-batches of neighbouring lengths (as equal in count as possible),
    so each micro-batch pads only to its own longest sentence."""
    ordered = sorted(indices, key=lambda i: sizes[i])
    parts = min(parts, len(ordered))
    base, extra = divmod(len(ordered), parts)
    out, start = [], 0
    for p in range(parts):
        end = start + base + (p < extra)
        out.append(ordered[start:end])
        start = end
    return out


@dataclass
class TruncationStats:
    sentences: int  # pairs with either side cut
    src_tokens_cut: int
    tgt_tokens_cut: int
    src_tokens: int  # before cutting
    tgt_tokens: int
    total_sentences: int

    def as_dict(self) -> dict:
        return {
            "sentences_truncated": self.sentences,
            "sentences_truncated_share": self.sentences / max(1, self.total_sentences),
            "src_tokens_cut": self.src_tokens_cut,
            "tgt_tokens_cut": self.tgt_tokens_cut,
            "tokens_cut_share": (self.src_tokens_cut + self.tgt_tokens_cut) / max(1, self.src_tokens + self.tgt_tokens),
        }


def truncate(split: EncodedSplit, max_src_len: int | None, max_tgt_len: int | None) -> tuple[EncodedSplit, TruncationStats]:
    """Cut sources to ``max_src_len`` and targets to ``max_tgt_len`` tokens (special tokens not counted)."""
    for key, value in (("memory.max_src_len", max_src_len), ("memory.max_tgt_len", max_tgt_len)):
        if value is not None and value < 1:
            raise ValueError(f"{key} must be >= 1 or null, got {value}")
    src, tgt = [], []
    stats = TruncationStats(0, 0, 0, 0, 0, len(split))
    for s, t in zip(split.src, split.tgt):
        stats.src_tokens += len(s)
        stats.tgt_tokens += len(t)
        cut_s = len(s) - max_src_len if max_src_len is not None and len(s) > max_src_len else 0
        cut_t = len(t) - max_tgt_len if max_tgt_len is not None and len(t) > max_tgt_len else 0
        stats.src_tokens_cut += cut_s
        stats.tgt_tokens_cut += cut_t
        stats.sentences += bool(cut_s or cut_t)
        src.append(s[: len(s) - cut_s])
        tgt.append(t[: len(t) - cut_t])
    return EncodedSplit(src, tgt), stats
