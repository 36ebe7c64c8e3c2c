"""Evaluation: teacher-forced validation loss, batched greedy decoding with a key/value cache, and sacreBLEU.

Hypotheses are detokenized by the target tokenizer and scored against the raw reference text with sacreBLEU's
corpus BLEU and chrF (default settings, 13a tokenization), whose signatures are recorded with the scores.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import Tensor

from .data.batching import batch_indices, collate, pad_stack, pair_sizes
from .data.encode import EncodedSplit
from .model import Transformer
from .tokenizers import Codec
from .trainer import batch_loss


@torch.no_grad()
def validation_loss(
    model: Transformer,
    split: EncodedSplit,
    codec: Codec,
    device: torch.device,
    batch_size: int,
    label_smoothing: float,
    autocast=contextlib.nullcontext,
    loss_chunk: int | None = None,
) -> dict[str, float]:
    """Per-token label-smoothed loss and negative log-likelihood (and its perplexity) over a split."""
    model.eval()
    sizes = pair_sizes(split)
    loss = nll = 0.0
    tokens = 0
    for idx in batch_indices(sizes, batch_size, shuffle=False):
        b = collate([split.src[i] for i in idx], [split.tgt[i] for i in idx], codec.pad_id, codec.bos_id, codec.eos_id)
        b = b.to(device)
        with autocast():
            ls, ns = batch_loss(model, b, codec.pad_id, label_smoothing, loss_chunk)
        loss, nll, tokens = loss + ls.item(), nll + ns.item(), tokens + b.n_tgt_tokens
    tokens = max(tokens, 1)
    return {"loss": loss / tokens, "nll": nll / tokens, "ppl": float(torch.tensor(nll / tokens).exp())}


@torch.no_grad()
def greedy_decode(
    model: Transformer,
    src: Tensor,
    bos_id: int,
    eos_id: int,
    pad_id: int,
    max_len: int,
) -> Tensor:
    """Greedy translations of a padded source batch (B, S) -> (B, <= max_len) token ids, ``pad_id`` after
    ``</s>``. Each step feeds only the newest token; earlier keys and values come from the cache. A sentence that
    has produced ``</s>`` leaves the batch, with its encoder states and cache rows, so the steps after it cost
    only what the unfinished sentences need."""
    model.eval()
    src_mask = model.src_mask(src)
    memory = model.encode(src, src_mask)
    caches: list[dict] = [{} for _ in model.decoder]
    batch = src.size(0)
    out = torch.full((batch, max_len), pad_id, dtype=torch.long, device=src.device)
    active = torch.arange(batch, device=src.device)  # rows of ``out`` still being decoded
    tokens = torch.full((batch, 1), bos_id, dtype=torch.long, device=src.device)
    length = 0
    for step in range(max_len):
        next_tok = model.decode_step(memory, src_mask, tokens, caches).argmax(dim=-1)
        out[active, step] = next_tok
        length = step + 1
        running = next_tok != eos_id
        if not bool(running.all()):
            if not bool(running.any()):
                break
            active, memory, src_mask, next_tok = active[running], memory[running], src_mask[running], next_tok[running]
            for cache in caches:
                for key in cache:
                    cache[key] = cache[key][running]
        tokens = next_tok.unsqueeze(1)
    return out[:, :length]


def translate_ids(
    model: Transformer,
    sources: Sequence[Tensor],
    src_codec: Codec,
    tgt_codec: Codec,
    device: torch.device,
    batch_size: int = 128,
    max_len_a: float = 1.5,
    max_len_b: int = 10,
    autocast=contextlib.nullcontext,
) -> list[list[int]]:
    """Greedy translations of encoded sources (no special tokens), in input order. Each batch may produce up
    to ``max_len_a * longest source + max_len_b`` tokens (fairseq's ``--max-len-a/b``)."""
    eos = torch.tensor([src_codec.eos_id])
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    results: list[list[int]] = [[] for _ in sources]
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        src = pad_stack([torch.cat([sources[i], eos]) for i in idx], src_codec.pad_id).to(device)
        max_len = int(max_len_a * src.size(1) + max_len_b)
        with autocast():
            hyp = greedy_decode(model, src, tgt_codec.bos_id, tgt_codec.eos_id, tgt_codec.pad_id, max_len)
        for row, i in zip(hyp.tolist(), idx):
            results[i] = row
    return results


def translate(
    model: Transformer,
    texts: Sequence[str],
    src_codec: Codec,
    tgt_codec: Codec,
    device: torch.device,
    **kwargs,
) -> list[str]:
    """Plain-text translations of plain-text sentences."""
    sources = [torch.tensor(ids, dtype=torch.long) for ids in src_codec.encode(texts)]
    return [tgt_codec.decode(ids) for ids in translate_ids(model, sources, src_codec, tgt_codec, device, **kwargs)]


def score(hypotheses: Sequence[str], references: Sequence[str]) -> dict:
    """Corpus BLEU and chrF of detokenized hypotheses against raw references, with sacreBLEU signatures."""
    from sacrebleu.metrics import BLEU, CHRF

    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses for {len(references)} references")
    bleu, chrf = BLEU(), CHRF()
    b = bleu.corpus_score(list(hypotheses), [list(references)])
    c = chrf.corpus_score(list(hypotheses), [list(references)])
    return {
        "bleu": round(b.score, 2),
        "chrf": round(c.score, 2),
        "bleu_signature": str(bleu.get_signature()),
        "chrf_signature": str(chrf.get_signature()),
    }
