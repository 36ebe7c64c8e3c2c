"""From encoded sentences to padded batches.

A batch holds ``batch_size`` sentence pairs (the sentences of one optimizer step). Within a shuffled pool of
``pool_batches`` batches, sentences are sorted by length before they are cut into batches, so batches carry little
padding but their order stays random (torchtext's BucketIterator, fairseq's length ordering).
Gradient accumulation cuts a batch into micro-batches of neighbouring lengths, each padded on its own.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .encode import EncodedSplit, PackedSequences, length_tensor


@dataclass
class Batch:
    src: Tensor  # (B, S): source ids, then </s>, right-padded
    tgt_in: Tensor  # (B, T): <s>, then target ids (decoder input)
    tgt_out: Tensor  # (B, T): target ids, then </s> (labels; padding is ignored by the loss)
    n_src_tokens: int  # non-pad tokens
    n_tgt_tokens: int

    def __len__(self) -> int:
        return self.src.size(0)

    @property
    def n_padded(self) -> int:
        """Source and target positions, padding included (what the model computes on)."""
        return self.src.numel() + self.tgt_out.numel()

    def to(self, device: torch.device) -> Batch:
        nb = device.type == "cuda"
        return Batch(
            self.src.to(device, non_blocking=nb),
            self.tgt_in.to(device, non_blocking=nb),
            self.tgt_out.to(device, non_blocking=nb),
            self.n_src_tokens,
            self.n_tgt_tokens,
        )


def gather(seqs: Sequence[Tensor], indices: Sequence[int]) -> tuple[Tensor, Tensor]:
    """The ids of the sentences ``indices`` end to end, as int64, and each one's length."""
    if isinstance(seqs, PackedSequences):
        return seqs.take(torch.as_tensor(indices, dtype=torch.long))
    chosen = [seqs[i] for i in indices]  # a list of tensors (tests; an overfit set; a file to translate)
    return torch.cat(chosen).long(), torch.tensor([len(s) for s in chosen], dtype=torch.long)


def pad_rows(ids: Tensor, lengths: Tensor, pad_id: int, bos_id: int | None = None, eos_id: int | None = None,
             pin: bool = False) -> Tensor:
    """Sentences given end to end in ``ids`` (``lengths``: each one's) as the rows of one tensor, each after
    ``bos_id`` and before ``eos_id`` (where given) and right-padded with ``pad_id``; ``pin``: in page-locked memory.
    All ids are put in place by one indexed copy."""
    first = int(bos_id is not None)
    rows = torch.full((len(lengths), first + int(lengths.max()) + int(eos_id is not None)), pad_id, dtype=ids.dtype,
                      pin_memory=pin)
    row = torch.repeat_interleave(lengths)  # each id's sentence
    rows[row, torch.arange(len(row)) - (torch.cumsum(lengths, 0) - lengths)[row] + first] = ids
    if bos_id is not None:
        rows[:, 0] = bos_id
    if eos_id is not None:
        rows[torch.arange(len(lengths)), lengths + first] = eos_id
    return rows


def collate(src: Sequence[Tensor], tgt: Sequence[Tensor], pad_id: int, bos_id: int, eos_id: int, pin: bool = False,
            indices: Sequence[int] | None = None) -> Batch:
    """The padded batch of the pairs ``indices`` (all by default); ``pin``: in page-locked host memory, whose copy
    to the GPU overlaps compute (for a batch bound for a GPU only: pinning starts a CUDA context, which a CPU run on
    a GPU machine does not need). Each side's ids are taken from the packed ids at once and put in place by one
    indexed copy: a step's batch of 16,384 tokens (1,092 Multi30k pairs) in 0.9 ms of host time, where a view, a
    ``torch.cat`` per sentence and side, then ``pad_sequence`` took 17 ms (experiments/foundation/collate_time.py).
    On a GPU this time is in every step's: the next batch is made after the step waits for the device."""
    indices = range(len(src)) if indices is None else indices
    (src_ids, src_len), (tgt_ids, tgt_len) = gather(src, indices), gather(tgt, indices)
    return Batch(pad_rows(src_ids, src_len, pad_id, eos_id=eos_id, pin=pin),
                 pad_rows(tgt_ids, tgt_len, pad_id, bos_id=bos_id, pin=pin),
                 pad_rows(tgt_ids, tgt_len, pad_id, eos_id=eos_id, pin=pin),
                 int(src_len.sum()) + len(src_len), int(tgt_len.sum()) + len(tgt_len))


def pair_sizes(split: EncodedSplit) -> array:
    """The padded size a pair costs: the longer of its source and target (each with one special token), as 4-byte
    ints (4.5M pairs: 17 MiB, where a list took 34; experiments/foundation/batch_memory.py)."""
    return _int32_array(torch.maximum(length_tensor(split.src), length_tensor(split.tgt)) + 1)


def target_sizes(split: EncodedSplit) -> array:
    """Each pair's target tokens with its ``</s>``, as 4-byte ints: what a step's loss is normalized by."""
    return _int32_array(length_tensor(split.tgt) + 1)


def _int32_array(values: Tensor) -> array:
    """A Python int per element when indexed, 4 bytes each, where a list holds an 8-byte pointer to each."""
    return array("i", values.to(torch.int32).numpy().tobytes())


def _size_tensor(sizes: Sequence[int]) -> Tensor:
    """``pair_sizes`` (or a list of sizes) as an int64 tensor: the array's 4-byte ints read at once."""
    if isinstance(sizes, array) and sizes.typecode == "i" and len(sizes):
        return torch.frombuffer(sizes, dtype=torch.int32).long()
    return torch.as_tensor(sizes, dtype=torch.long)


class EpochBatches:
    """An epoch's batches: the pairs' indices batch after batch in one tensor, and where each batch begins.
    Indexed, a batch is a list of ints; sliced, the batches of that range (sharing the tensor); iterated, each
    batch's list in turn. As lists of Python ints (36 bytes an index), an epoch of WMT14's 4.5M pairs held
    176 MiB for as long as it trained; here, 8 bytes an index."""

    def __init__(self, pairs: Tensor, lengths: Tensor | list[int]):
        self.pairs = pairs
        lengths = torch.as_tensor(lengths, dtype=torch.long)
        self.bounds = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])  # batch k: bounds[k]:bounds[k+1]

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def __getitem__(self, k: int | slice) -> list[int] | EpochBatches:
        if isinstance(k, slice):
            first, stop, stride = k.indices(len(self))
            if stride != 1:
                raise ValueError("EpochBatches slices take every batch of their range")
            stop = max(first, stop)
            return EpochBatches(self.pairs[int(self.bounds[first]):int(self.bounds[stop])],
                                self.bounds[first + 1:stop + 1] - self.bounds[first:stop])
        k = range(len(self))[k]  # (a negative index counts from the end; out of range raises IndexError)
        return self.pairs[int(self.bounds[k]):int(self.bounds[k + 1])].tolist()

    def __iter__(self):
        bounds = self.bounds.tolist()
        for first, stop in zip(bounds, bounds[1:]):
            yield self.pairs[first:stop].tolist()

    def tolist(self) -> list[list[int]]:
        return list(self)

    def __eq__(self, other) -> bool:  # the same batches, in the same order (another EpochBatches, or lists)
        if isinstance(other, EpochBatches):
            return torch.equal(self.pairs, other.pairs) and torch.equal(self.bounds, other.bounds)
        return self.tolist() == other if isinstance(other, list) else NotImplemented

    __hash__ = None

    def lengths(self) -> Tensor:
        return self.bounds.diff()

    def without(self, done: Tensor) -> EpochBatches:
        """These batches without the pairs that ``done`` (a bool per pair of the corpus) marks, in the same order;
        the batches left empty are left out."""
        kept = ~done[self.pairs]
        counts = torch.cat([kept.new_zeros(1, dtype=torch.long), torch.cumsum(kept, 0)])
        lengths = counts[self.bounds[1:]] - counts[self.bounds[:-1]]
        return EpochBatches(self.pairs[kept], lengths[lengths > 0])

    def reordered(self, order: Tensor) -> EpochBatches:
        """The same batches in ``order`` (a permutation of their positions)."""
        lengths = self.lengths()[order]
        moved = self.bounds[:-1][order] - (torch.cumsum(lengths, 0) - lengths)  # where each batch's pairs come from
        return EpochBatches(self.pairs[torch.arange(len(self.pairs)) + moved.repeat_interleave(lengths)], lengths)


def _pair_order(n: int, shuffle: bool, seed: int, epoch: int) -> tuple[torch.Generator | None, Tensor]:
    """The epoch's generator (a function of ``(seed, epoch)``; none without ``shuffle``) and the pairs' first order
    (drawn from it, or as they are)."""
    if not shuffle:
        return None, torch.arange(n)
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return g, torch.randperm(n, generator=g)


def _in_drawn_order(batches: EpochBatches, g: torch.Generator | None) -> EpochBatches:
    """The batches in an order drawn from the epoch's generator, where it shuffles."""
    return batches if g is None else batches.reordered(torch.randperm(len(batches), generator=g))


def batch_indices(
    sizes: Sequence[int], batch_size: int, shuffle: bool, seed: int = 0, epoch: int = 0, pool_batches: int = 100
) -> EpochBatches:
    """Sentence indices of each batch for one epoch; every index appears exactly once.

    With ``shuffle``, the order is a function of ``(seed, epoch)`` alone, so a run is reproducible."""
    if batch_size < 1:
        raise ValueError(f"data.batch_size={batch_size}: must be >= 1")
    n = len(sizes)
    g, order = _pair_order(n, shuffle, seed, epoch)
    pool = batch_size * pool_batches
    if n:  # sorted by size within each pool (stable: equal sizes keep the shuffled order)
        size = _size_tensor(sizes)[order]
        order = order[torch.sort(torch.arange(n) // pool * (int(size.max()) + 1) + size, stable=True).indices]
    full, rest = divmod(n % pool, batch_size)  # each pool cut into batches of batch_size; the last pool's last shorter
    lengths = [batch_size] * (n // pool * pool_batches + full) + ([rest] if rest else [])
    return _in_drawn_order(EpochBatches(order, lengths), g)


def split_batch(indices: list[int], sizes: Sequence[int], parts: int) -> list[list[int]]:
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


def check_token_budget(max_tokens: int, largest: int) -> None:
    """A token budget must hold the largest pair, of ``largest`` tokens as ``pair_sizes`` counts them."""
    if largest > max_tokens:
        raise ValueError(
            f"data.max_tokens={max_tokens} is smaller than the longest training pair ({largest} tokens with "
            "its special token); raise it, or cut long sentences with memory=truncate"
        )


def token_batch_indices(
    sizes: Sequence[int], max_tokens: int, shuffle: bool, seed: int = 0, epoch: int = 0
) -> EpochBatches:
    """Batches under a token budget, padding counted: a batch of n pairs costs n x its largest pair size, and
    no batch costs more than ``max_tokens`` (fairseq's ``--max-tokens``). Pairs are sorted by size (ties in a
    random order) before they are packed, so batches carry little padding; the batch order is then shuffled.
    Every index appears exactly once; the order is a function of ``(seed, epoch)``."""
    if max_tokens < 1:
        raise ValueError(f"data.max_tokens must be >= 1, got {max_tokens}")
    size = _size_tensor(sizes)
    if len(size):
        check_token_budget(max_tokens, int(size.max()))
    g, order = _pair_order(len(size), shuffle, seed, epoch)
    order = order[torch.sort(size[order], stable=True).indices]  # stable: equal sizes keep their random order
    return _in_drawn_order(EpochBatches(order, _packed_lengths(size[order], max_tokens)), g)


def _packed_lengths(ascending: Tensor, max_tokens: int) -> list[int]:
    """The batch lengths of packing pairs of ``ascending`` sizes in turn: a pair joins the open batch unless the
    batch would then cost more than ``max_tokens`` (its pairs times the newest pair's size, the largest), and
    then opens the next one. Worked out a size at a time, not a pair at a time (a Python loop over 4.5M pairs)."""
    sizes, counts = torch.unique_consecutive(ascending, return_counts=True)
    lengths, open_batch = [], 0
    for size, count in zip(sizes.tolist(), counts.tolist()):
        fits = max_tokens // size  # pairs of this size in one batch (at least 1: check_token_budget)
        if open_batch >= fits:  # the next pair, of this size, would overflow it
            lengths.append(open_batch)
            open_batch = 0
        joining = min(count, fits - open_batch)
        open_batch, count = open_batch + joining, count - joining
        if count:  # it is full: whole batches of this size follow, then the rest opens a batch
            full, rest = divmod(count, fits)
            lengths += [open_batch] + [fits] * full
            open_batch = rest
    return lengths + ([open_batch] if open_batch else [])


def epoch_batches(
    sizes: Sequence[int], batch_size: int, max_tokens: int | None, shuffle: bool, seed: int = 0, epoch: int = 0
) -> EpochBatches:
    """One epoch's batches: by token budget when ``max_tokens`` is set, else ``batch_size`` pairs each."""
    if max_tokens:
        return token_batch_indices(sizes, max_tokens, shuffle, seed, epoch)
    return batch_indices(sizes, batch_size, shuffle, seed, epoch)


def micro_batches(split: EncodedSplit, indices: list[int], sizes: Sequence[int], parts: int, pad_id: int, bos_id: int,
                  eos_id: int, pin: bool = False) -> list[Batch]:
    """One optimizer step's batch as ``parts`` padded micro-batches of neighbouring lengths (``split_batch``)."""
    return [collate(split.src, split.tgt, pad_id, bos_id, eos_id, pin, part) for part in split_batch(indices, sizes, parts)]


@dataclass
class LengthLimitStats:
    overlong: str  # what happened to pairs over the limits: "truncate" (cut) or "drop" (removed)
    pairs: int  # pairs over a limit
    src_tokens_removed: int
    tgt_tokens_removed: int
    src_tokens: int  # before
    tgt_tokens: int
    total_pairs: int

    def as_dict(self) -> dict:
        return {
            "overlong": self.overlong,
            "pairs_before": self.total_pairs,
            "pairs_affected": self.pairs,
            "pairs_affected_share": self.pairs / max(1, self.total_pairs),
            "src_tokens_removed": self.src_tokens_removed,
            "tgt_tokens_removed": self.tgt_tokens_removed,
            "tokens_removed_share": (self.src_tokens_removed + self.tgt_tokens_removed)
            / max(1, self.src_tokens + self.tgt_tokens),
        }


def limit_lengths(
    split: EncodedSplit, max_src_len: int | None, max_tgt_len: int | None, overlong: str = "truncate"
) -> tuple[EncodedSplit, LengthLimitStats]:
    """Sources over ``max_src_len`` and targets over ``max_tgt_len`` tokens (special tokens not counted) are cut
    to the limit (``overlong="truncate"``) or their pairs removed (``"drop"``). Each side is cut on its own, and a
    cut sentence keeps its </s> (collate adds it), as Hugging Face tokenizers truncate: labelling a cut target's
    end with padding instead left the model unable to end long sentences (README, memory strategies). The result
    stays packed (a tensor per sentence took 1.1 GB more for a million pairs)."""
    if overlong not in ("truncate", "drop"):
        raise ValueError(f"memory.overlong={overlong}: expected truncate or drop")
    lengths = {side: length_tensor(getattr(split, side)) for side in ("src", "tgt")}
    caps = {"src": max_src_len, "tgt": max_tgt_len}
    cut = {side: (n - caps[side]).clamp(min=0) if caps[side] is not None else torch.zeros_like(n)
           for side, n in lengths.items()}
    over = (cut["src"] > 0) | (cut["tgt"] > 0)
    removed = {side: int((lengths[side] * over).sum() if overlong == "drop" else cut[side].sum()) for side in cut}
    stats = LengthLimitStats(overlong, int(over.sum()), removed["src"], removed["tgt"], int(lengths["src"].sum()),
                             int(lengths["tgt"].sum()), len(split))
    if not over.any() and isinstance(split.src, PackedSequences) and isinstance(split.tgt, PackedSequences):
        return split, stats  # nothing to cut: no copy of the ids
    kept = ~over if overlong == "drop" else torch.ones_like(over)
    sides = [_cut_packed(getattr(split, side), lengths[side], lengths[side] - cut[side], kept) for side in cut]
    return EncodedSplit(*sides), stats


# Sentences cut at a time: each id's position takes 8 bytes in each of the temporaries that find it, about 30 bytes
# an id for a whole split at once (a run cutting 1M pairs of 15 ids, 57 MiB of ids a side, peaked 387 MiB higher).
CUT_GROUP = 100_000


def _cut_packed(seqs, lengths: Tensor, new_lengths: Tensor, kept: Tensor) -> PackedSequences:
    """The first ``new_lengths`` ids of each sentence of ``seqs`` that is ``kept``, packed."""
    ids = seqs.ids if isinstance(seqs, PackedSequences) else torch.cat([torch.as_tensor(s, dtype=torch.int64)
                                                                        for s in seqs] or [torch.zeros(0)]).long()
    starts, pieces = torch.cumsum(lengths, 0) - lengths, []
    for first in range(0, len(lengths), CUT_GROUP):
        n, cut, kept_here = (t[first:first + CUT_GROUP] for t in (lengths, new_lengths, kept))
        part = ids.narrow(0, int(starts[first]), int(n.sum()))
        position = torch.arange(len(part)) - (torch.cumsum(n, 0) - n).repeat_interleave(n)
        pieces.append(part[(position < cut.repeat_interleave(n)) & kept_here.repeat_interleave(n)])
    return PackedSequences(torch.cat(pieces) if pieces else ids[:0], new_lengths[kept])
