"""Evaluation: teacher-forced validation loss, batched greedy decoding and beam search with a key/value cache, and
sacreBLEU.

Hypotheses are detokenized by the target tokenizer (an unknown token as one word, ``tokenizers.UNK_TEXT``) and
scored against the raw reference text with sacreBLEU's corpus BLEU and chrF (sacreBLEU's defaults; BLEU tokenizes
as ``bleu_metric`` says: 13a, or the target language's own tokenizer for Chinese, Japanese and Korean), whose
signatures are recorded with the scores. ``Evaluator`` does all of it for a run, on its evaluation sets
(``evaluation_sets``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
import unicodedata
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
from torch import Tensor

from .data.batching import batch_indices, collate, gather, pad_rows, pair_sizes
from .data.corpus import Corpus, ParallelText
from .data.encode import EncodedCorpus, EncodedSplit
from .errors import ConfigError, NumericalError, UserError
from .memory import MemoryStrategy
from .model import Transformer
from .tokenizers import Codec
from .trainer import batch_loss

T = TypeVar("T")
log = logging.getLogger(__name__)


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
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # summed where computed: no host copy a batch
    tokens = 0
    pin = torch.device(device).type == "cuda"
    for idx in batch_indices(sizes, batch_size, shuffle=False):
        b = collate(split.src, split.tgt, codec.pad_id, codec.bos_id, codec.eos_id, pin, idx)
        b = b.to(device)
        with autocast():
            ls, ns = batch_loss(model, b, codec.pad_id, label_smoothing, loss_chunk)
        sums += torch.stack([ls, ns]).double()
        tokens += b.n_tgt_tokens
    loss, nll = sums.tolist()
    tokens = max(tokens, 1)
    return {"loss": loss / tokens, "nll": nll / tokens, "ppl": float(torch.tensor(nll / tokens).exp())}


@torch.no_grad()
def greedy_decode(
    model: Transformer,
    src: Tensor,
    bos_id: int,
    eos_id: int,
    pad_id: int,
    max_len: int | Sequence[int],
    never: Sequence[int] = (),
) -> Tensor:
    """Greedy translations of a padded source batch (B, S) -> (B, <= max_len) token ids, ``pad_id`` after
    ``</s>``; ``max_len``: for every sentence, or one per sentence; ``never``: other ids no translation holds
    (``Codec.other_specials``). Each step feeds only the newest token; earlier
    keys and values come from the cache. A sentence that has produced ``</s>`` or reached its ``max_len`` leaves
    the batch, with its encoder states and cache rows, so the steps after it cost only what the unfinished
    sentences need."""
    model.eval()
    src_mask = model.src_mask(src)
    memory = model.encode(src, src_mask)
    caches: list[dict] = [{} for _ in model.decoder]
    batch = src.size(0)
    limit = _limits(max_len, batch).to(src.device)
    out = torch.full((batch, int(limit.max())), pad_id, dtype=torch.long, device=src.device)
    active = torch.arange(batch, device=src.device)  # rows of ``out`` still being decoded
    tokens = torch.full((batch, 1), bos_id, dtype=torch.long, device=src.device)
    length = 0
    never = _never_generated(bos_id, eos_id, pad_id, never, src.device)
    for step in range(out.size(1)):
        best, next_tok = model.decode_step(memory, src_mask, tokens, caches).index_fill_(-1, never, -math.inf).max(-1)
        out[active, step] = next_tok.masked_fill(limit <= step, pad_id)  # a max_len of 0: none
        length = step + 1
        running = (next_tok != eos_id) & (limit > length)
        # one host sync a step: whether all go on, whether any does, whether a row's scores are NaN
        all_run, any_run, nan = torch.stack([running.all(), running.any(), best.isnan().any()]).tolist()
        if nan:  # max takes NaN for the largest: the translation would be a NaN row's arbitrary token
            raise NumericalError(f"greedy decoding: a sentence's scores are NaN at step {step + 1} (the model's "
                                 "outputs are not finite: its weights, or a checkpoint's)")
        if not all_run:
            if not any_run:
                break
            # memory is not selected: the first step cached its keys and values (reorder_cache selects them)
            active, src_mask, next_tok = active[running], src_mask[running], next_tok[running]
            limit = limit[running]
            model.reorder_cache(caches, running, running)
        tokens = next_tok.unsqueeze(1)
    return out[:, :length]


def _never_generated(bos_id: int, eos_id: int, pad_id: int, others: Sequence[int], device: torch.device) -> Tensor:
    """The ids a translation never holds: padding, ``<s>`` (fairseq forbids padding likewise) and ``others`` (the
    tokenizer's other special tokens). An untrained model's argmax can be any of them, which the detokenizer
    drops, so the text scored was not the one searched."""
    return torch.tensor(sorted({bos_id, pad_id, *others} - {eos_id}), dtype=torch.long, device=device)


def _limits(max_len: int | Sequence[int], batch: int) -> Tensor:
    """The longest translation allowed for each of ``batch`` sentences."""
    if isinstance(max_len, int):
        return torch.full((batch,), max_len)
    limit = torch.as_tensor(max_len)
    assert limit.shape == (batch,), (limit.shape, batch)
    return limit


def length_penalty(length: int, alpha: float) -> float:
    """GNMT's length normalization (Wu et al. 2016), which "Attention Is All You Need" decodes with (alpha 0.6):
    a hypothesis scores its log-probability divided by ((5 + length) / 6) ** alpha; alpha 0 is the plain sum."""
    return ((5 + length) / 6) ** alpha


@torch.no_grad()
def beam_search(
    model: Transformer,
    src: Tensor,
    bos_id: int,
    eos_id: int,
    pad_id: int,
    max_len: int | Sequence[int],
    beam_size: int,
    alpha: float = 0.0,
    never: Sequence[int] = (),
) -> tuple[Tensor, Tensor]:
    """Beam-search translations of a padded source batch (B, S) -> (B, <= max_len) token ids, ``pad_id`` after
    ``</s>``, and their scores (B,), as fairseq does it. ``max_len``: for every sentence, or one per sentence.
    Each sentence keeps ``beam_size`` open hypotheses in the key/value cache; a candidate ending in ``</s>`` among
    the best ``beam_size`` of a step is set aside as finished, and a sentence is done once it has ``beam_size``
    finished ones (or at its ``max_len``, where its open ones count as they are). The best finished hypothesis
    by ``log-probability / length_penalty(length, alpha)`` wins, its length counting ``</s>``. Done sentences
    leave the batch. With ``beam_size`` 1 this is greedy decoding. ``never``: as ``greedy_decode``'s."""
    model.eval()
    k = beam_size
    src_mask = model.src_mask(src)
    memory = model.encode(src, src_mask)
    batch, device = src.size(0), src.device
    # Rows are (sentence, beam) pairs, k per sentence; ``sent`` holds the sentences still open, by index in ``src``.
    # ``memory`` and the encoder keys and values keep one row per open sentence, shared by its k hypotheses.
    sent = list(range(batch))
    scores = torch.full((batch, k), float("-inf"), device=device)
    scores[:, 0] = 0.0  # one hypothesis to start from, so the first step does not pick k copies of the best token
    history = torch.full((batch * k, 0), pad_id, dtype=torch.long, device=device)
    tokens = torch.full((batch * k, 1), bos_id, dtype=torch.long, device=device)
    caches: list[dict] = [{} for _ in model.decoder]
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(batch)]  # (normalized score, ids)
    limit = _limits(max_len, batch).tolist()
    never = _never_generated(bos_id, eos_id, pad_id, never, device)
    for step in range(max(limit)):
        logp = torch.log_softmax(model.decode_step(memory, src_mask, tokens, caches, k).float(), dim=-1)
        logp.index_fill_(-1, never, -math.inf)  # after the softmax: the other tokens' scores are the model's
        vocab = logp.size(-1)
        candidates = (scores.view(-1, 1) + logp).view(len(sent), k * vocab)
        # 2k candidates: at most k of them end (one per hypothesis), so k that go on remain.
        top, index = candidates.topk(min(2 * k, k * vocab), dim=-1)
        parent = torch.arange(len(sent), device=device).unsqueeze(1) * k + index // vocab  # the row it extends
        token = index % vocab
        ends = token == eos_id
        ending = [(i, j) for i, j in (ends[:, :k] & top[:, :k].isfinite()).nonzero().tolist()  # only the best k
                  if limit[sent[i]] > step]  # a max_len of 0: nothing
        _set_aside(finished, sent, ending, history, parent, token, top, length_penalty(step + 1, alpha))
        go_on = (~ends).int().argsort(dim=-1, descending=True, stable=True)[:, :k]  # the best k that do not end
        scores, parent, token = top.gather(1, go_on), parent.gather(1, go_on), token.gather(1, go_on)
        # at its max_len, a sentence's open hypotheses count as they are
        at_limit = [i for i, s in enumerate(sent) if limit[s] == step + 1 and len(finished[s]) < k]
        if at_limit:
            finite = scores.isfinite().tolist()
            _set_aside(finished, sent, [(i, j) for i in at_limit for j in range(k) if finite[i][j]], history,
                       parent, token, scores, length_penalty(step + 1, alpha))
        still_open = [len(finished[s]) < k and limit[s] > step + 1 for s in sent]
        if not any(still_open):
            break
        keep = None
        if not all(still_open):  # done sentences leave the batch
            keep = torch.tensor(still_open, device=device)
            sent = [s for s, o in zip(sent, still_open) if o]
            scores, parent, token = scores[keep], parent[keep], token[keep]
            src_mask = src_mask[keep]  # memory's keys and values are cached: reorder_cache selects them
        rows = parent.view(-1)
        history = torch.cat([history[rows], token.view(-1, 1)], dim=1)
        model.reorder_cache(caches, rows, keep)
        tokens = token.view(-1, 1)
    for s, f in enumerate(finished):
        if not f and limit[s] > 0:  # every candidate was NaN or -inf: set aside, none would have finished
            raise NumericalError(f"beam search: no hypothesis of sentence {s} has a finite score (the model's "
                                 "outputs are NaN or infinite: its weights, or a checkpoint's)")
    best = [max(f, key=lambda h: h[0]) if f else (0.0, []) for f in finished]  # max_len 0: empty, as greedy
    out = torch.full((batch, max(len(ids) for _, ids in best)), pad_id, dtype=torch.long, device=device)
    for i, (_, ids) in enumerate(best):
        out[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out, torch.tensor([score for score, _ in best])


def _set_aside(finished: list[list[tuple[float, list[int]]]], sent: list[int], where: list[tuple[int, int]],
               history: Tensor, parent: Tensor, token: Tensor, score: Tensor, penalty: float) -> None:
    """Add the hypotheses at ``where`` (pairs of open sentence, candidate) to their sentences' ``finished`` ones:
    the tokens of the row each extends, then its token. Two copies to the host for them all, not two for each."""
    if not where:
        return
    i, j = torch.tensor(where, device=history.device).unbind(1)
    ids = torch.cat([history[parent[i, j]], token[i, j].unsqueeze(1)], dim=1).tolist()
    for (row, _), s, h in zip(where, score[i, j].tolist(), ids):
        finished[sent[row]].append((s / penalty, h))


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
    beam_size: int = 1,
    alpha: float = 0.0,
    max_positions: int | None = None,
) -> list[list[int]]:
    """Translations of encoded sources (no special tokens), in input order: greedy, or by beam search where
    ``beam_size`` > 1 (``alpha``: its length penalty). Each sentence may produce up to ``max_len_a * its source
    length + max_len_b`` tokens, ``</s>`` counted on both sides (fairseq's ``--max-len-a/b``, which fairseq applies
    with the longest source of the batch): so a translation does not depend on the sentences batched with it, and
    ``batch_size`` changes nothing but rounding. A source of no tokens (a blank line a held-out split keeps) has an
    empty translation, as translate.py writes for a blank line: it is not decoded. No translation is longer than
    ``max_positions`` (None: any length), as fairseq caps it at the decoder's positions."""
    order = sorted((i for i in range(len(sources)) if len(sources[i])), key=lambda i: len(sources[i]))
    results: list[list[int]] = [[] for _ in sources]
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        src = pad_rows(*gather(sources, idx), src_codec.pad_id, eos_id=src_codec.eos_id).to(device)
        max_len = [int(max_len_a * (len(sources[i]) + 1) + max_len_b) for i in idx]
        if max_positions is not None:
            max_len = [min(n, max_positions) for n in max_len]
        specials = tgt_codec.bos_id, tgt_codec.eos_id, tgt_codec.pad_id
        with autocast():
            if beam_size == 1:
                hyp = greedy_decode(model, src, *specials, max_len, never=tgt_codec.other_specials)
            else:
                hyp, _ = beam_search(model, src, *specials, max_len, beam_size, alpha, never=tgt_codec.other_specials)
        for row, i in zip(hyp.tolist(), idx):
            results[i] = row
    return results


def translate(
    model: Transformer,
    texts: Sequence[str],
    src_codec: Codec,
    tgt_codec: Codec,
    device: torch.device,
    source_name: str = "input",
    max_positions: int | None = None,
    **kwargs,
) -> list[str]:
    """Plain-text translations of plain-text sentences; a blank one's is empty (it is not tokenized either). A
    sentence longer than ``max_positions`` (0: any; None: the model's) is refused as ``source_name:<line>``, before
    any decoding."""
    kept = [i for i, text in enumerate(texts) if text.strip()]
    sources = [torch.tensor(ids, dtype=torch.long) for ids in src_codec.encode([texts[i] for i in kept])]
    unknown = [(i, n) for i, ids in zip(kept, sources) if (n := int((ids == src_codec.unk_id).sum()))]
    if unknown:  # the model reads each as one token it was taught little about: its translation guesses
        log.warning("%s: %d source word(s) not in the vocabulary, in %d line(s) (the first: line %d); each is read as "
                    "the unknown token", source_name, sum(n for _, n in unknown), len(unknown), unknown[0][0] + 1)
    limit = model.args.max_positions if max_positions is None else max_positions or None
    for i, ids in zip(kept, sources, strict=True):
        if limit is not None and len(ids) + 1 > limit:
            whose = "the model's max_positions" if max_positions is None else "--max-positions"
            raise UserError(f"{source_name}:{i + 1}: {len(ids) + 1:,} source positions (with the special token), "
                            f"above {whose}={limit}; split that line, or allow it with "
                            "--max-positions (0: any length; decoding it may need a lot of memory)")
    out = [""] * len(texts)
    for i, ids in zip(kept, translate_ids(model, sources, src_codec, tgt_codec, device, max_positions=limit, **kwargs)):
        out[i] = tgt_codec.decode(ids)
    return out


# Languages written without spaces between words that sacreBLEU has no word tokenizer for offline (its flores200
# model is downloaded): BLEU over characters. 13a would see each sentence as one word, and score a perfect
# translation 0.
CHARACTER_BLEU = frozenset({"th", "lo", "km", "my", "bo", "dz"})
# The three-letter codes (ISO 639-2 and -3) of the languages whose BLEU tokenizer is not 13a
THREE_LETTER = {"zho": "zh", "chi": "zh", "cmn": "zh", "jpn": "ja", "kor": "ko", "tha": "th", "lao": "lo",
                "khm": "km", "mya": "my", "bur": "my", "bod": "bo", "tib": "bo", "dzo": "dz"}


def bleu_language(tgt_lang: str | None) -> str:
    """The language code sacreBLEU chooses a tokenizer by: the language of ``zh-CN``, ``zh_TW``, ``ZH`` or ``zho``
    (file names of OPUS corpora carry regions), which sacreBLEU knows only as ``zh``: given as is, it tokenized
    Chinese with 13a, each sentence one word."""
    lang = (tgt_lang or "").replace("_", "-").split("-")[0].lower()
    return THREE_LETTER.get(lang, lang)


def bleu_metric(lowercase: bool = False, tgt_lang: str | None = None):
    """sacreBLEU's BLEU with the tokenizer it uses for the target language, as its command line does with ``-l``:
    13a, or ``zh``, ``ja-mecab``, ``ko-mecab`` for Chinese, Japanese, Korean (the last two need ``sacrebleu[ja]``,
    ``sacrebleu[ko]``: ``check_scoring`` says so before training); ``char`` for ``CHARACTER_BLEU``'s languages."""
    from sacrebleu.metrics import BLEU

    lang = bleu_language(tgt_lang)
    if lang in CHARACTER_BLEU:
        return BLEU(lowercase=lowercase, tokenize="char")
    return BLEU(lowercase=lowercase, trg_lang=lang)


def check_scoring(tgt_lang: str | None) -> None:
    try:
        bleu_metric(tgt_lang=tgt_lang)
    except RuntimeError as e:  # sacreBLEU's message: what to install
        raise ConfigError(f"data.tgt_lang={tgt_lang}: BLEU needs its tokenizer: {' '.join(str(e).split())}") from None


def score(hypotheses: Sequence[str], references: Sequence[str], lowercase: bool = False,
          tgt_lang: str | None = None) -> dict:
    """Corpus BLEU and chrF of detokenized hypotheses against raw references, with sacreBLEU signatures;
    ``lowercase``: case-insensitive (for a tokenizer that lowercases; the signatures then say ``case:lc``);
    ``tgt_lang``: BLEU tokenizes as sacreBLEU does for that language (``bleu_metric``). Both sides are compared in
    Unicode's composed form (NFC), which the spaCy tokenizer writes: references typed with combining accents (NFD)
    would otherwise miss every accented word of a correct translation (text already in NFC, as Multi30k's, is
    unchanged)."""
    from sacrebleu.metrics import CHRF

    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses for {len(references)} references")
    hypotheses = [unicodedata.normalize("NFC", h) for h in hypotheses]
    references = [unicodedata.normalize("NFC", r) for r in references]
    bleu, chrf = bleu_metric(lowercase, tgt_lang), CHRF(lowercase=lowercase)
    b = bleu.corpus_score(hypotheses, [references])
    c = chrf.corpus_score(hypotheses, [references])
    return {
        "bleu": round(b.score, 2),
        "chrf": round(c.score, 2),
        "bleu_signature": str(bleu.get_signature()),
        "chrf_signature": str(chrf.get_signature()),
    }


@dataclasses.dataclass
class EvalSet:
    """What a validation or the test translates (``encoded``) and scores against (``text.tgt``)."""

    encoded: EncodedSplit
    text: ParallelText


def evaluation_sets(corpus: Corpus, encoded: EncodedCorpus, limit: int | None = None,
                    overfit: tuple[EncodedSplit, list[int]] | None = None) -> dict[str, EvalSet]:
    """The validation and test sets: the corpus's, or their first ``limit`` pairs (trainer.limit_eval). With
    ``overfit`` (the training split and the pairs of trainer.overfit_batches), both are those training pairs,
    scored against their targets as training sees them (decoded), so that BLEU shows what the model memorized."""
    if overfit is not None:
        train_split, pairs = overfit
        src, tgt = [train_split.src[i] for i in pairs], [train_split.tgt[i] for i in pairs]
        text = ParallelText([encoded.src_codec.decode(s) for s in src], [encoded.tgt_codec.decode(t) for t in tgt])
        sets = dict.fromkeys(("valid", "test"), EvalSet(EncodedSplit(src, tgt), text))
    else:
        sets = {k: EvalSet(encoded.splits[k], corpus.splits[k]) for k in ("valid", "test")}
    if limit:
        sets = {k: EvalSet(EncodedSplit(s.encoded.src[:limit], s.encoded.tgt[:limit]),
                           ParallelText(s.text.src[:limit], s.text.tgt[:limit])) for k, s in sets.items()}
    return sets


def unknown_words(hyp_ids: Sequence[Sequence[int]], eos_id: int, unk_id: int) -> int:
    """The unknown tokens the translations hold up to their ``</s>``: each is written as the word
    ``tokenizers.UNK_TEXT``, one wrong word in BLEU (a small vocabulary's cost)."""
    return sum(list(ids[:ids.index(eos_id)] if eos_id in ids else ids).count(unk_id) for ids in hyp_ids)


class Evaluator:
    """A run's validation loss and translations of its evaluation sets, at its precision and with its decoding
    settings. Out of memory (the training state leaves evaluation less room than it had at the start, beams
    multiply the rows): again with half the batch, kept for the rest of the run, down to one sentence. A
    sentence's translation does not depend on its batch (``translate_ids``), its scores only by rounding."""

    def __init__(self, sets: dict[str, EvalSet], encoded: EncodedCorpus, device: torch.device, tr: dict,
                 label_smoothing: float, strategy: MemoryStrategy, tgt_lang: str):
        self.sets, self.device, self.tr, self.tgt_lang = sets, device, tr, tgt_lang
        self.src_codec, self.tgt_codec = encoded.src_codec, encoded.tgt_codec
        self.label_smoothing, self.strategy = label_smoothing, strategy
        self.batch_size = tr["eval_batch_size"]
        self.decode_s: dict[str, float] = {}  # seconds of the latest decoding of each set

    def autocast(self):
        return self.strategy.autocast(self.device)

    def loss(self, model: Transformer) -> dict[str, float]:
        return self._backing_off(lambda batch: validation_loss(
            model, self.sets["valid"].encoded, self.tgt_codec, self.device, batch, self.label_smoothing, self.autocast,
            self.strategy.loss_chunk), "the validation loss")

    def translate(self, model: Transformer, split: str) -> tuple[dict, list[str]]:
        """The scores and the translations of one set."""
        s, tr = self.sets[split], self.tr
        t0 = time.perf_counter()
        hyp_ids = self._backing_off(lambda batch: translate_ids(
            model, s.encoded.src, self.src_codec, self.tgt_codec, self.device, batch, tr["max_len_a"],
            tr["max_len_b"], self.autocast, tr["beam_size"], tr["length_penalty"], model.args.max_positions),
            f"decoding the {split} set")
        self.decode_s[split] = round(time.perf_counter() - t0, 3)
        hyps = [self.tgt_codec.decode(ids) for ids in hyp_ids]
        scores = score(hyps, s.text.tgt, self.tgt_codec.lowercase, self.tgt_lang)
        scores["unk_words"] = unknown_words(hyp_ids, self.tgt_codec.eos_id, self.tgt_codec.unk_id)
        return scores, hyps

    def _backing_off(self, task: Callable[[int], T], what: str) -> T:
        while True:
            try:
                return task(self.batch_size)
            except torch.OutOfMemoryError as e:
                if self.batch_size == 1:
                    raise
                reason = str(e).splitlines()[0]
                self.batch_size //= 2
            log.warning("out of memory in %s: %s; again with evaluation batches of %d", what, reason, self.batch_size)

