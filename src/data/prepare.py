"""A run's data as training reads it: the configured corpus, its encoding (cached), checked against the model's
positions, and the training split after the memory strategy's truncation and vocabulary trimming."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from ..distributed import World
from ..errors import ConfigError, DataError
from ..memory import MemoryStrategy
from ..tokenizers import SPECIALS, SpacyCodec
from .batching import limit_lengths
from .corpus import MULTI30K_URL, Corpus, load_files, load_multi30k, load_synthetic
from .encode import EncodedCorpus, EncodedSplit, encode_corpus, seq_lengths, trim_vocabulary
from .synthetic import LengthDistribution

log = logging.getLogger(__name__)


def load_corpus(data: dict, cache_dir: Path, download_ok: bool = True) -> Corpus:
    name = data.get("name")
    src, tgt = data["src_lang"], data["tgt_lang"]
    if src == tgt:  # a sanity check one may run on purpose, or a typo: said, not refused
        log.warning("data.src_lang=data.tgt_lang=%s: the model learns to copy its input, not to translate", src)
    if name == "synthetic":
        try:
            lengths = LengthDistribution(
                **{k: data[k] for k in ("continue_prob", "max_clauses", "long_fraction", "long_clauses") if k in data}
            )
        except ValueError as e:  # it names the key
            raise ConfigError(str(e)) from None
        sizes = {"train": data["train_size"], "valid": data["valid_size"], "test": data["test_size"]}
        return load_synthetic(src, tgt, sizes, data["seed"], lengths)
    if name == "multi30k":
        return load_multi30k(src, tgt, data.get("root"), cache_dir, data.get("url") or MULTI30K_URL, download_ok)
    if name == "files":
        prefixes = {split: data.get(f"{split}_prefix") for split in ("train", "valid", "test")}
        return load_files(prefixes, src, tgt)
    raise ConfigError(f"data.name={name!r}: expected synthetic, multi30k or files")



def check_positions(corpus: Corpus, encoded: EncodedCorpus, limit: int | None, strategy: MemoryStrategy,
                    tr: dict) -> None:
    """Refuse a pair longer than model.max_positions (with its special token), naming its file and line: one stray
    line of 100,000 words made a step that exhausted the host's memory, and the kernel killed the run without a
    word. The training split is measured as truncation leaves it (memory.max_src_len / max_tgt_len), the held-out
    splits as far as they are evaluated (trainer.limit_eval; not at all under trainer.overfit_batches)."""
    if limit is None:
        return
    caps = {"src": strategy.max_src_len if strategy.truncates else None,
            "tgt": strategy.max_tgt_len if strategy.truncates else None}
    for side, cap in caps.items():
        if cap is not None and cap + 1 > limit:
            raise ConfigError(f"memory.max_{side}_len={cap}: above model.max_positions={limit} less the special "
                              f"token; set at most {limit - 1}, or raise model.max_positions")
    for name, split in encoded.splits.items():
        held_out = name != "train"
        if held_out and tr.get("overfit_batches"):
            continue  # evaluated on training batches
        cut = {"src": None, "tgt": None} if held_out else caps
        evaluated = tr.get("limit_eval") if held_out else None
        src_lens, tgt_lens = [], []
        for side, ids, lens in (("src", split.src, src_lens), ("tgt", split.tgt, tgt_lens)):
            lens += [min(n, cut[side] or n) + 1 for n in seq_lengths(ids)[:evaluated]]
        i = next((i for i, (s, t) in enumerate(zip(src_lens, tgt_lens, strict=True)) if max(s, t) > limit), None)
        if i is not None:
            fix = "remove or split that line" if held_out else (
                "cut long sentences with memory=truncate (memory.overlong=drop leaves such pairs out)")
            raise DataError(f"{corpus.where(name, i, side=int(tgt_lens[i] > limit >= src_lens[i]))}: "
                            f"{src_lens[i]:,} source / {tgt_lens[i]:,} target positions (with the special token), "
                            f"above model.max_positions={limit}; {fix}, or raise model.max_positions (attention over "
                            "N positions holds N x N scores per head)")



def check_vocabularies(corpus: Corpus, encoded: EncodedCorpus, tokenizer: dict) -> None:
    """A vocabulary built from the training text holds a word (one of special tokens alone trains a model that
    translates every word as the unknown token)."""
    for codec, lang in ((encoded.src_codec, corpus.src_lang), (encoded.tgt_codec, corpus.tgt_lang)):
        if isinstance(codec, SpacyCodec) and len(codec) <= len(SPECIALS):
            raise ConfigError(f"tokenizer.min_freq={tokenizer.get('min_freq')}: no {lang} word of the training text "
                              "is seen that often, so its vocabulary holds the special tokens alone; lower it")


def prepare_data(conf: dict, strategy: MemoryStrategy, download_ok: bool = True, world: World | None = None
                 ) -> tuple[Corpus, EncodedCorpus, EncodedSplit, dict]:
    """The corpus, its encoding (cached), the training split after truncation, and what was done to it. Under
    torchrun each machine's first rank downloads and tokenizes, and the others load its cache."""
    cache_dir = Path(conf["paths"]["cache_dir"]).expanduser()
    with (world or World()).local_main_first():
        corpus = load_corpus(conf["data"], cache_dir, download_ok)
        encoded = encode_corpus(corpus, conf["tokenizer"], cache_dir)
        corpus.let_go_of_training_text()
    check_positions(corpus, encoded, conf["model"].get("max_positions"), strategy, conf["trainer"])
    check_vocabularies(corpus, encoded, conf["tokenizer"])
    info: dict = {"sentences": {k: len(v) for k, v in encoded.splits.items()},
                  "data": {**corpus.description, "digest": corpus.digest}}  # what was read, and its text's digest
    if encoded.encode_peak_rss_mb is not None:
        info["encode_peak_rss_mb"] = round(encoded.encode_peak_rss_mb, 1)
    train_split = encoded.splits["train"]
    if strategy.truncates:
        train_split, limited = limit_lengths(train_split, strategy.max_src_len, strategy.max_tgt_len, strategy.overlong)
        info["length_limit"] = limited.as_dict()
        log.info(
            "truncate (%s): %d of %d training pairs over the limits, %.2f%% of the tokens removed",
            strategy.overlong, limited.pairs, limited.total_pairs, 100 * info["length_limit"]["tokens_removed_share"],
        )
        if not len(train_split):
            raise DataError("every training pair is longer than memory.max_src_len / max_tgt_len; raise them")
        info["sentences"]["train"] = len(train_split)  # the pairs trained on (overlong=drop leaves some out)
        # the pairs as cut are the corpus's training split from here on: the uncut ids are let go, not held beside
        # them for the whole run
        encoded = dataclasses.replace(encoded, splits={**encoded.splits, "train": train_split})
    if strategy.trim_vocab:  # after truncation: the pieces of the pairs trained on, as they are trained on
        from ..building import count_parameters  # (the model's modules: only here)

        full = encoded
        encoded = trim_vocabulary(encoded, train_split)
        train_split = encoded.splits["train"]
        info["trim_vocab"] = {
            "vocab_before": {"src": len(full.src_codec), "tgt": len(full.tgt_codec)},
            "vocab_after": {"src": len(encoded.src_codec), "tgt": len(encoded.tgt_codec)},
            "parameters_before": count_parameters(conf["model"], full),
            "parameters_after": count_parameters(conf["model"], encoded),
        }
        log.info("trim_vocab: %s", info["trim_vocab"])
    src_codec, tgt_codec = encoded.src_codec, encoded.tgt_codec
    info["vocab"] = {"src": len(src_codec), "tgt": len(tgt_codec), "shared": src_codec is tgt_codec}
    return corpus, encoded, train_split, info

