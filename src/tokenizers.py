"""Tokenizers ("codecs"): text <-> token ids, one per language or one shared by both.

- ``spacy``: spaCy's rule-based tokenizer for the language (``spacy.blank(lang)``, or a named pipeline where one
  is installed), a word vocabulary built from the training split, and a detokenizer learned from the same text
  (which tokens attach to their neighbours without a space), so hypotheses are scored as plain text.
- ``xlmr``: the Hugging Face XLM-RoBERTa sentencepiece tokenizer (250,002 pieces for ``xlm-roberta-base``),
  by hub name or local path, shared by source and target.

Special ids follow fairseq and XLM-R: ``<s>`` 0, ``<pad>`` 1, ``</s>`` 2, ``<unk>`` 3. Decoding writes an unknown
token as ``UNK_TEXT`` by both tokenizers: one word that matches no reference word, as sentencepiece writes it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import unicodedata
from array import array
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import ConfigError, check_int
from .fileio import atomic_dir, atomic_path, write_json
from .network import unreachable

if TYPE_CHECKING:
    from torch import Tensor

log = logging.getLogger(__name__)

SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")
BOS, PAD, EOS, UNK = range(4)
# An unknown token in a translation: sentencepiece's rendering. sacreBLEU's 13a tokenizer keeps it one token; the
# text "<unk>" it splits into three ("<", "unk", ">"), which lengthened a hypothesis by two tokens per unknown word
# (lifting the brevity penalty) and added n-grams that never match: a spaCy run's BLEU depended on how often it
# wrote <unk> (12.97 against 14.89 on the throughput workload), and XLM-R's decoding dropped it instead.
UNK_TEXT = "\u2047"


class Codec:
    """What the rest of the project needs from a tokenizer."""

    bos_id: int
    pad_id: int
    eos_id: int
    unk_id: int
    lowercase: bool = False  # text is lowercased before tokenizing: its translations can only be scored uncased

    def __len__(self) -> int:
        raise NotImplementedError

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, without special tokens."""
        raise NotImplementedError

    def encode_counting(self, texts: Sequence[str]) -> tuple[list[list[int]], int]:
        """``encode``'s ids, and how many special tokens written in the text it encoded as ``<unk>`` (said by the
        caller, once for a whole split, not by ``encode`` for each chunk of it)."""
        return self.encode(texts), 0

    def decode(self, ids: Iterable[int]) -> str:
        """Plain text of a hypothesis; stops at ``</s>`` and drops the other special tokens."""
        raise NotImplementedError

    @property
    def other_specials(self) -> tuple[int, ...]:
        """The ids of special tokens beside ``<s>``, ``<pad>``, ``</s>`` and ``<unk>`` (XLM-R's ``<mask>``): never
        a translation's, as decoding would drop them."""
        return ()

    def save(self, directory: Path) -> None:
        """Write the files ``state()`` refers to, if any (``save_codecs`` writes the state itself)."""

    def state(self) -> dict:
        """A JSON-able description from which ``codec_from_state`` rebuilds the codec."""
        raise NotImplementedError

    def vocab_digest(self) -> str:
        """What each token id stands for, as a short hash: a checkpoint's embeddings are of these ids, and a
        vocabulary of the same size with other words would load and train on without an error."""
        return _digest(self.state())


def _digest(data) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------------------------ spaCy


def spacy_tokenizer(lang: str, model: str | None = None):
    import spacy  # imported here: runs with tokenizer=xlmr do not need spaCy

    if model:
        key = f"tokenizer.models.{lang}={model}"
        if _looks_like_path(model):  # a pipeline written by nlp.to_disk (check_pipeline_dir)
            check_pipeline_dir(key, model)
        try:
            return spacy.load(model).tokenizer
        except OSError:
            raise ConfigError(
                f"{key}: spaCy pipeline not installed; install it if spaCy publishes one of that name (python -m "
                f"spacy download {model}; not every language has one) or remove the key to use spacy.blank('{lang}')"
            ) from None
        except Exception as e:  # e.g. an installed package that is no pipeline
            raise ConfigError(f"{key}: not a spaCy pipeline ({type(e).__name__}: {e})") from None
    try:
        return spacy.blank(lang).tokenizer
    except ImportError as e:
        if "[E048]" in str(e):  # Can't import language ... from spacy.lang
            code = lang.replace("_", "-").split("-")[0].lower()  # zh-CN, pt_BR, ZH: spaCy's codes have no region
            hint = f"; spaCy's codes have no region or capitals: {code}?" if code != lang else ""
            raise ConfigError(f"spaCy has no language '{lang}'{hint}; check data.src_lang / data.tgt_lang") from None
        # a language whose tokenizer needs another package (th: PyThaiNLP, ja: SudachiPy, ...)
        install = f" ({SPACY_EXTRAS[lang]})" if lang in SPACY_EXTRAS else ""
        raise ConfigError(f"spaCy's '{lang}' tokenizer: {str(e).strip().splitlines()[0]}{install}") from None


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", ".", "~")) or Path(name).expanduser().is_dir()


def check_pipeline_dir(key: str, name: str) -> None:
    """A spaCy pipeline given as a directory: one that ``nlp.to_disk`` wrote (a run trained with it keeps its
    tokenizer: ``SpacyCodec.save``)."""
    path = Path(name).expanduser()
    if not path.is_dir():
        what = "not a" if path.exists() else "no such"
        raise ConfigError(f"{key}: {what} directory; give a pipeline directory written by nlp.to_disk, or an "
                          "installed pipeline's name")
    if not (path / "config.cfg").is_file():
        raise ConfigError(f"{key}: not a spaCy pipeline directory (no config.cfg); give one written by nlp.to_disk")


# What spacy.blank(lang) needs besides spaCy, where its own message names no command
SPACY_EXTRAS = {"th": "pip install pythainlp", "vi": "pip install pyvi"}


def _mostly(cases: Iterable[tuple[str, bool]]) -> set[str]:
    """Tokens seen in at least 3 of the ``(token, yes)`` cases and with ``yes`` in most of them."""
    counts: dict[str, list[int]] = {}
    for token, yes in cases:
        c = counts.setdefault(token, [0, 0])
        c[0] += yes
        c[1] += 1
    return {token for token, (yes, n) in counts.items() if n >= 3 and yes * 2 > n}


def learn_glue(docs: Sequence[tuple[Sequence[str], bytes]]) -> tuple[set[str], set[str], set[str]]:
    """Detokenization rules from tokenized lines, each as ``(tokens, whether each is followed by a space)``: the
    tokens that attach to the previous token ("," "." ")"), those that attach to the next ("(" "l'"), and those that
    alternate, opening then closing within a line (straight quotes: ``a "bath" in``). Rare tokens keep their
    spaces."""

    def quote_cases(opening: bool) -> Iterator[tuple[str, bool]]:
        """(token, behaves as an opening / a closing quote) for its odd / even occurrences in each line."""
        for tokens, spaces in docs:
            seen: Counter[str] = Counter()
            for i, text in enumerate(tokens):
                seen[text] += 1
                if seen[text] % 2 == opening:
                    before = i > 0 and not spaces[i - 1]  # attached to the previous token
                    after = i + 1 < len(tokens) and not spaces[i]  # attached to the next token
                    yield text, (after and not before) if opening else (before and not after)

    def gaps() -> Iterator[tuple[str, str, bool]]:
        return ((a, b, not space) for tokens, spaces in docs for a, b, space in zip(tokens, tokens[1:], spaces))

    def left(explained: set[str]) -> set[str]:
        return _mostly((b, glued) for a, b, glued in gaps() if a not in explained)

    def right(explained: set[str]) -> set[str]:
        return _mostly((a, glued) for a, b, glued in gaps() if b not in explained)

    # Quotes are punctuation ("pom" in "pom-pom" also opens and closes in turn).
    paired = {t for t in _mostly(quote_cases(True)) & _mostly(quote_cases(False)) if not any(c.isalnum() for c in t)}
    # A gap belongs to the token that explains it: "air" in "l'air" does not learn to glue left once "l'" glues
    # right, nor a word before "." to glue right. One round of each side against the other settles both.
    glue_left = left(paired)
    glue_right = right(glue_left | paired)
    glue_left = left(glue_right | paired)
    glue_right = right(glue_left | paired)
    return glue_left, glue_right, paired


def learn_spacing(docs: Sequence[tuple[Sequence[str], bytes]]) -> tuple[bool, set[str], set[str]]:
    """Whether the text separates its tokens with spaces (most gaps between two tokens of a line hold one; not so in
    Chinese, Japanese or Thai, whose spaces are the exception), and for text that does not: the tokens that take a
    space before them, and those that take one after (a Latin word set apart in Chinese text, say). Rare tokens
    take none."""
    def gaps() -> Iterator[tuple[str, str, bool]]:  # read as they come: a tuple each took 56 bytes a token
        return ((a, b, bool(space)) for tokens, spaces in docs for a, b, space in zip(tokens, tokens[1:], spaces))

    spaced = sum(sum(spaces[:-1]) for _, spaces in docs)  # the gaps between two tokens that hold a space
    if 2 * spaced >= sum(max(len(tokens) - 1, 0) for tokens, _ in docs):
        return True, set(), set()
    return False, _mostly((b, space) for _, b, space in gaps()), _mostly((a, space) for a, _, space in gaps())


# The training lines the detokenization rules are learned from, drawn from a larger split: learn_glue's passes
# over every gap took 10 s per 300,000 lines, and holding every line's tokens for them 1 GB per million.
RULES_SAMPLE = 500_000
# Token ids renumbered at a time once a vocabulary is sorted (4 MB).
RENUMBER_CHUNK = 1 << 20
PROGRESS_EVERY_LINES = 1000  # how often build_encoding tells its caller how far it is


def rules_sample(lines: int) -> bytearray:
    """Which of a training split's lines the detokenization rules learn from: every one, up to RULES_SAMPLE; else
    RULES_SAMPLE of them, drawn at random (seeded by the count: the same lines every time), not every k-th line,
    which a corpus made of repeated blocks would alias."""
    if lines <= RULES_SAMPLE:
        return bytearray(b"\x01") * lines
    chosen = bytearray(lines)
    for i in random.Random(lines).sample(range(lines), RULES_SAMPLE):  # (a set of the indices drawn, or a list of
        chosen[i] = 1  # every index for a split of up to about 1M lines: tens of MB while it draws)
    return chosen


def saved_tokenizer_name(lang: str, model: str) -> str:
    """The file ``SpacyCodec.save`` keeps a pipeline directory's tokenizer in (one per language and directory)."""
    return f"spacy-{lang}-{_digest(model)[:8]}.tokenizer"


class SpacyCodec(Codec):
    bos_id, pad_id, eos_id, unk_id = BOS, PAD, EOS, UNK

    def __init__(
        self,
        lang: str,
        itos: list[str],
        glue_left: Iterable[str] = (),
        glue_right: Iterable[str] = (),
        model: str | None = None,
        lowercase: bool = False,
        paired: Iterable[str] = (),
        spaced: bool = True,
        space_left: Iterable[str] = (),
        space_right: Iterable[str] = (),
        saved: Path | None = None,
    ):
        """``saved``: the tokenizer of ``model``, a pipeline directory, as ``save`` kept it with a run."""
        if tuple(itos[: len(SPECIALS)]) != SPECIALS:
            raise ValueError(f"vocabulary must start with {SPECIALS}")
        self.lang, self.itos, self.model, self.lowercase = lang, list(itos), model, lowercase
        self.stoi = {tok: i for i, tok in enumerate(self.itos)}
        self.glue_left, self.glue_right, self.paired = set(glue_left), set(glue_right), set(paired)
        # text written without spaces between words (learn_spacing): tokens join, but for those that take a space
        self.spaced, self.space_left, self.space_right = spaced, set(space_left), set(space_right)
        self._tokenizer, self.saved = None, saved

    @property
    def tokenizer(self):
        if self._tokenizer is None and self.saved is not None:  # the run's own copy of its pipeline's tokenizer
            import spacy

            self._tokenizer = spacy.blank(self.lang).tokenizer.from_disk(self.saved)
        elif self._tokenizer is None:
            self._tokenizer = spacy_tokenizer(self.lang, self.model)
        return self._tokenizer

    def save(self, directory: Path) -> None:
        """A pipeline given as a directory: its tokenizer (rules and exceptions) kept with the run, which then
        translates after the directory has moved or changed. An installed pipeline's name, or none
        (``spacy.blank``), is found again by name."""
        if self.model and _looks_like_path(self.model):
            with atomic_path(directory / saved_tokenizer_name(self.lang, self.model)) as tmp:
                self.tokenizer.to_disk(tmp)


    def spacy_docs(self, texts: Sequence[str]) -> Iterator:
        """Each text's spaCy doc, in Unicode's composed form (NFC; after lowercasing, which can decompose: T with
        a combining diaeresis, U+0308, lowercases to "t" and the mark): a word typed with combining accents (NFD)
        is the vocabulary's word, not ``<unk>``. BLEU compares NFC text too (``evaluate.score``)."""
        texts = [t.lower() for t in texts] if self.lowercase else texts
        return self.tokenizer.pipe([unicodedata.normalize("NFC", t) for t in texts], batch_size=1000)

    def tokenize_docs(self, texts: Sequence[str]) -> Iterator[list]:
        """Each text as its spaCy tokens, without the whitespace tokens spaCy makes of runs of spaces (a double
        space in 88 lines of Multi30k's German training text), tabs and no-break spaces: words are what is
        separated by whitespace, as for the trainers that read spaCy-tokenized text split on spaces."""
        for doc in self.spacy_docs(texts):
            yield [t for t in doc if not t.is_space]

    def token_lines(self, texts: Sequence[str]) -> Iterator[tuple[tuple[str, ...], bytes]]:
        """Each text as (its tokens, whether each is followed by whitespace), one str object per distinct token: a
        training split held this way takes a few MB, where a (str, bool) pair per token took 43 MB for Multi30k's
        German, and the process kept that memory after it was freed (its small blocks lay among the vocabulary's).
        A whitespace token (a tab, a no-break space: 48 in Multi30k's German training text) is the space after the
        token before it, which spaCy records as followed by nothing."""
        distinct: dict[str, str] = {}
        for doc in self.spacy_docs(texts):
            tokens, spaced = [], []
            for t in doc:
                if t.is_space:
                    if spaced:
                        spaced[-1] = True
                    continue
                tokens.append(distinct.setdefault(t.text, t.text))
                spaced.append(bool(t.whitespace_))
            yield tuple(tokens), bytes(spaced)

    def tokenize(self, texts: Sequence[str]) -> list[list[str]]:
        return [[t.text for t in doc] for doc in self.tokenize_docs(texts)]

    @classmethod
    def build(cls, *args, **kwargs) -> SpacyCodec:
        """``build_encoding``'s codec alone."""
        return cls.build_encoding(*args, **kwargs)[0]

    @classmethod
    def build_encoding(
        cls,
        texts: Sequence[str],
        lang: str,
        min_freq: int = 1,
        max_size: int | None = None,
        model: str | None = None,
        lowercase: bool = False,
        progress: Callable[[int], None] | None = None,
    ) -> tuple[SpacyCodec, Tensor, Tensor]:
        """Vocabulary and detokenization rules from training text: tokens seen ``min_freq`` times or more, most
        frequent first (ties alphabetical), at most ``max_size`` including the specials. And the ids of ``texts``
        as the codec's ``encode`` gives them, end to end (int32), with each text's length (int64): one spaCy pass
        over the training text, where building and then encoding took two. Each distinct token is numbered as first
        seen, then renumbered once the vocabulary is sorted. ``progress``, where given, is told the lines done
        every PROGRESS_EVERY_LINES lines."""
        import torch  # (here: the rest of this module needs no torch)

        def tensor(values: array, dtype: torch.dtype) -> Tensor:  # (the array's memory; frombuffer refuses none)
            return torch.frombuffer(values, dtype=dtype) if len(values) else torch.zeros(0, dtype=dtype)

        codec = cls(lang, list(SPECIALS), model=model, lowercase=lowercase)
        seen: dict[str, int] = {}  # each distinct token: its number in the order first seen
        flat, lengths = array("i"), array("q")
        docs, sampled = [], rules_sample(len(texts))  # the lines the detokenization rules learn from
        for i, (tokens, spaces) in enumerate(codec.token_lines(texts)):
            flat.extend([seen.setdefault(t, len(seen)) for t in tokens])
            lengths.append(len(tokens))
            if sampled[i]:
                docs.append((tokens, spaces))
            if progress is not None and i % PROGRESS_EVERY_LINES == 0:
                progress(i)
        ids = tensor(flat, torch.int32)
        counts = torch.bincount(ids, minlength=len(seen)).tolist()
        if texts and len(ids) < 1.5 * len(texts):  # Thai given as xx, which splits at spaces only
            log.warning("spaCy's '%s' tokenizer made %.1f tokens per training sentence: the vocabulary holds whole "
                        "sentences, as this text has almost no spaces; give the language's own code (data.src_lang / "
                        "data.tgt_lang), or use tokenizer=xlmr", lang, len(ids) / len(texts))
        distinct = list(seen)
        kept = sorted((j for j, c in enumerate(counts) if c >= min_freq), key=lambda j: (-counts[j], distinct[j]))
        if max_size is not None:
            kept = kept[: max(0, max_size - len(SPECIALS))]
        renumbered = torch.full((len(seen),), UNK, dtype=torch.int32)
        renumbered[torch.tensor(kept, dtype=torch.int64)] = torch.arange(len(kept), dtype=torch.int32) + len(SPECIALS)
        for start in range(0, len(ids), RENUMBER_CHUNK):  # in place, a chunk at a time
            ids[start:start + RENUMBER_CHUNK] = torch.index_select(renumbered, 0, ids[start:start + RENUMBER_CHUNK])
        glue_left, glue_right, paired = learn_glue(docs)
        spaced, space_left, space_right = learn_spacing(docs)
        built = cls(lang, list(SPECIALS) + [distinct[j] for j in kept], sorted(glue_left), sorted(glue_right), model,
                    lowercase, sorted(paired), spaced, sorted(space_left), sorted(space_right))
        return built, ids, tensor(lengths, torch.int64)

    def __len__(self) -> int:
        return len(self.itos)

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        unk, stoi = self.unk_id, self.stoi
        return [[stoi.get(t.text, unk) for t in doc] for doc in self.tokenize_docs(texts)]

    def detokenize(self, tokens: Sequence[str]) -> str:
        if not self.spaced:
            return "".join(f" {tok}" if i and (tokens[i - 1] in self.space_right or tok in self.space_left) else tok
                           for i, tok in enumerate(tokens))
        out: list[str] = []
        opened: set[str] = set()  # paired tokens (quotes) opened and not yet closed
        prev_glues_right = True  # no space before the first token
        for tok in tokens:
            if tok in self.paired:  # a quote attaches to what it encloses
                closes = tok in opened
                opened ^= {tok}
                glues_left, glues_right = closes, not closes
            else:
                glues_left, glues_right = tok in self.glue_left, tok in self.glue_right
            if not (prev_glues_right or glues_left):
                out.append(" ")
            out.append(tok)
            prev_glues_right = glues_right
        return "".join(out)

    def decode(self, ids: Iterable[int]) -> str:
        tokens = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if i not in (self.bos_id, self.pad_id):
                tokens.append(UNK_TEXT if i == self.unk_id else self.itos[i])
        return self.detokenize(tokens)

    def vocab_digest(self) -> str:
        return _digest(self.itos)  # (not the detokenizing rules, which a resumed run may learn anew)

    def state(self) -> dict:
        return {
            "type": "spacy",
            "lang": self.lang,
            "model": self.model,
            "lowercase": self.lowercase,
            "itos": self.itos,
            "glue_left": sorted(self.glue_left),
            "glue_right": sorted(self.glue_right),
            "paired": sorted(self.paired),
            "spaced": self.spaced,
            "space_left": sorted(self.space_left),
            "space_right": sorted(self.space_right),
        }


# --------------------------------------------------------------------------------------- Hugging Face / XLM-R


def hub_unreachable() -> str | None:
    """Why the Hugging Face hub (``HF_ENDPOINT``) cannot be reached, asked once (``network.unreachable``), or None
    (it answers; or HF_HUB_OFFLINE is set, under which nothing is asked). ``from_pretrained`` retries a connection
    that fails for about 50 s before it says so."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return None
    from huggingface_hub import constants

    why = unreachable(constants.ENDPOINT)
    return why and f"at {constants.ENDPOINT}: {why}"


def written_specials(found: int) -> str:
    return f"{found:,} special token(s) such as <s>, </s> or <pad> written in the text; encoded as <unk>"


class HFCodec(Codec):
    """A Hugging Face tokenizer (XLM-R's sentencepiece model), loaded by hub name or local directory.

    A hub name already in Hugging Face's cache is loaded from there without a request: online, the hub would only
    be asked whether the files changed, and on a machine without network (a cluster's compute node) each request is
    retried for about 25 s before the cache is used, minutes a run. A name not in the cache is downloaded, once the
    hub is found to answer (``hub_unreachable``)."""

    def __init__(self, name_or_path: str):
        from transformers import AutoTokenizer  # imported here: only tokenizer=xlmr needs transformers

        local = check_tokenizer_path(name_or_path)
        try:
            self.tok = None
            if local is None:
                with contextlib.suppress(OSError, ValueError):  # not in the cache, or not all of it: ask the hub
                    self.tok = AutoTokenizer.from_pretrained(name_or_path, local_files_only=True)
            if self.tok is None:
                if local is None and (why := hub_unreachable()):
                    raise OSError(f"cannot reach the Hugging Face hub {why}")
                self.tok = AutoTokenizer.from_pretrained(str(local) if local else name_or_path)
        except (OSError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if local:
                what = "give a directory written by save_pretrained"
            else:
                what = ("without network, point it at a local directory written by save_pretrained, or load it once "
                        "where the hub answers (then it is read from Hugging Face's cache)")
            raise ConfigError(f"tokenizer.name_or_path={name_or_path}: cannot load a tokenizer ({first}); {what}") from None
        self.name_or_path = name_or_path
        t = self.tok
        self.bos_id, self.pad_id, self.eos_id, self.unk_id = (
            t.bos_token_id, t.pad_token_id, t.eos_token_id, t.unk_token_id
        )
        if None in (self.bos_id, self.pad_id, self.eos_id, self.unk_id):
            raise ConfigError(f"tokenizer.name_or_path={name_or_path}: needs <s>, <pad>, </s> and <unk> tokens")

    def __len__(self) -> int:
        return len(self.tok)

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text. A special token written out in the text (``<s>``, ``</s>``, ``<pad>``, which
        the tokenizer matches as text) becomes ``<unk>``: as ``</s>`` it would end the sentence in training."""
        ids, found = self.encode_counting(texts)
        if found:
            log.warning("%s", written_specials(found))
        return ids

    def encode_counting(self, texts: Sequence[str]) -> tuple[list[list[int]], int]:
        if not texts:
            return [], 0  # (the tokenizer raises IndexError on an empty batch)
        ids = self.tok(list(texts), add_special_tokens=False, return_attention_mask=False)["input_ids"]
        special = set(self.tok.all_special_ids) - {self.unk_id}
        found = sum(i in special for seq in ids for i in seq)
        if found:
            ids = [[self.unk_id if i in special else i for i in seq] for seq in ids]
        return ids, found

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids`` up to ``</s>``; an unknown piece as the word ``UNK_TEXT`` (the tokenizer's own
        decoding drops it with the other special tokens)."""
        words, piece_ids = [], []
        for i in [*map(int, ids), self.eos_id]:
            if i in (self.eos_id, self.unk_id):
                # sentencepiece's spaces as they are: the cleanup some tokenizer configs switch on (transformers
                # 4's default) would join "cat ." and " 's" that the model wrote apart
                words.append(self.tok.decode(piece_ids, skip_special_tokens=True,
                                             clean_up_tokenization_spaces=False).strip())
                piece_ids = []
                if i == self.eos_id:
                    break
                words.append(UNK_TEXT)
            else:
                piece_ids.append(i)
        return " ".join(w for w in words if w)

    @property
    def other_specials(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.tok.all_special_ids) - {self.bos_id, self.pad_id, self.eos_id, self.unk_id}))

    def state(self) -> dict:
        return {"type": "hf", "name_or_path": self.name_or_path, "vocab_size": len(self)}

    def vocab_digest(self) -> str:
        return _digest(sorted(self.tok.get_vocab().items(), key=lambda item: item[1]))

    def save(self, directory: Path) -> None:
        with atomic_dir(directory / "hf") as tmp:  # whole or not at all: translate.py loads it
            self.tok.save_pretrained(tmp)


# ------------------------------------------------------------------------------------------ trimmed vocabulary


class TrimmedCodec(Codec):
    """A codec restricted to the ids in ``kept`` (memory=trim_vocab), renumbered ``0..len(kept)-1`` in their
    original order. Ids outside ``kept`` encode as ``<unk>``; decoding maps back and lets the base codec decode."""

    def __init__(self, base: Codec, kept: Sequence[int]):
        self.base, self.kept = base, sorted(set(kept))
        self.new_id = {old: new for new, old in enumerate(self.kept)}
        specials = (base.bos_id, base.pad_id, base.eos_id, base.unk_id)
        missing = [i for i in specials if i not in self.new_id]
        if missing:
            raise ValueError(f"a trimmed vocabulary must keep the special ids {specials}; missing {missing}")
        self.bos_id, self.pad_id, self.eos_id, self.unk_id = (self.new_id[i] for i in specials)

    @property
    def lowercase(self) -> bool:
        return self.base.lowercase

    def __len__(self) -> int:
        return len(self.kept)

    def lookup_table(self) -> list[int]:
        """New id of each base id (``<unk>`` where the id was dropped)."""
        table = [self.unk_id] * (max(len(self.base), self.kept[-1] + 1))
        for new, old in enumerate(self.kept):
            table[old] = new
        return table

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        new_id, unk = self.new_id, self.unk_id
        return [[new_id.get(i, unk) for i in ids] for ids in self.base.encode(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.base.decode(self.kept[int(i)] for i in ids)

    @property
    def other_specials(self) -> tuple[int, ...]:
        return tuple(self.new_id[i] for i in self.base.other_specials if i in self.new_id)

    def state(self) -> dict:
        return {"type": "trimmed", "base": self.base.state(), "kept": self.kept}

    def vocab_digest(self) -> str:
        return _digest([self.base.vocab_digest(), self.kept])

    def save(self, directory: Path) -> None:
        self.base.save(directory)


# ------------------------------------------------------------------------------------------------ building


def check_tokenizer(spec: dict, langs: Sequence[str] = ()) -> None:
    """The tokenizer group's settings, before the data is read (spaCy tokenizes in child processes, whose
    errors would come back as their tracebacks); ``langs``: the run's source and target languages."""
    name = spec.get("name")
    if name == "spacy":
        check_int("tokenizer.min_freq", spec.get("min_freq"), 1)
        check_int("tokenizer.max_vocab", spec.get("max_vocab"), 5, nullable=True)  # 4 specials and a word
        if not isinstance(spec.get("lowercase"), bool):
            raise ConfigError(f"tokenizer.lowercase={spec.get('lowercase')}: expected true or false")
        models = spec.get("models")
        if models is not None and (not isinstance(models, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in models.items())):
            raise ConfigError(f"tokenizer.models={models}: expected a pipeline name per language, e.g. "
                              "+tokenizer.models.de=de_core_news_sm")
        for lang, model in (models or {}).items():
            if not model.strip():
                raise ConfigError(f"tokenizer.models.{lang}: empty; give a pipeline's name or directory, or remove "
                                  f"the key to use spacy.blank('{lang}')")
            if _looks_like_path(model):
                check_pipeline_dir(f"tokenizer.models.{lang}={model}", model)
            if all(langs) and lang not in langs:  # (a preset may name pipelines of several language pairs)
                log.warning("tokenizer.models.%s: not a language of this run (%s->%s), so not used", lang, *langs)
    elif name == "xlmr":
        if not isinstance(spec.get("name_or_path"), str) or not spec["name_or_path"]:
            raise ConfigError(f"tokenizer.name_or_path={spec.get('name_or_path')}: expected a hub name or a "
                              "directory written by save_pretrained")
        check_tokenizer_path(spec["name_or_path"])
    else:
        raise ConfigError(f"tokenizer.name={name!r}: expected spacy or xlmr")


def check_tokenizer_path(name_or_path: str) -> Path | None:
    """The local directory ``name_or_path`` names (``~`` expanded), or None for a hub name. A name written as a
    path (``/``, ``.`` or ``~`` first) must be a directory."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if name_or_path.startswith(("/", ".", "~")):
        raise ConfigError(f"tokenizer.name_or_path={name_or_path}: {'not a' if path.exists() else 'no such'} "
                          "directory; give a directory written by save_pretrained, or a hub name")
    return None


def spacy_options(spec: dict, lang: str) -> dict:
    """``SpacyCodec.build``'s keywords for one side from the ``tokenizer`` config."""
    return {"min_freq": spec.get("min_freq", 1), "max_size": spec.get("max_vocab"),
            "model": (spec.get("models") or {}).get(lang), "lowercase": spec.get("lowercase", False)}


def build_codec(spec: dict, lang: str, train: Sequence[str]) -> Codec:
    """The codec of one side for the ``tokenizer`` config: spaCy's vocabulary is built from that side's training
    text alone (so the two sides can be built apart); XLM-R's is one for both sides and reads no text."""
    name = spec.get("name")
    if name == "spacy":
        return SpacyCodec.build(train, lang, **spacy_options(spec, lang))
    if name == "xlmr":
        return HFCodec(spec["name_or_path"])
    raise ConfigError(f"tokenizer.name={name!r}: expected spacy or xlmr")


def build_spacy_encoding(spec: dict, lang: str, train: Sequence[str], progress: Callable[[int], None] | None = None
                         ) -> tuple[SpacyCodec, Tensor, Tensor]:
    """``build_codec``'s spaCy codec of one side and the ids of its training text, in one pass over the text
    (``SpacyCodec.build_encoding``)."""
    return SpacyCodec.build_encoding(train, lang, **spacy_options(spec, lang), progress=progress)


def codec_from_state(state: dict, directory: Path | None = None) -> Codec:
    if state["type"] == "spacy":
        saved = directory / saved_tokenizer_name(state["lang"], state["model"]) if directory and state["model"] else None
        return SpacyCodec(
            state["lang"], state["itos"], state["glue_left"], state["glue_right"], state["model"], state["lowercase"],
            state.get("paired", ()),  # vocabularies saved before quotes were paired
            state.get("spaced", True), state.get("space_left", ()), state.get("space_right", ()),  # (or spacing)
            saved if saved is not None and saved.is_file() else None,
        )
    if state["type"] == "hf":
        local = directory / "hf" if directory is not None else None
        return HFCodec(str(local) if local is not None and local.is_dir() else state["name_or_path"])
    if state["type"] == "trimmed":
        return TrimmedCodec(codec_from_state(state["base"], directory), state["kept"])
    raise ValueError(f"unknown codec type {state['type']!r}")


def save_codecs(directory: Path, src: Codec, tgt: Codec) -> None:
    """The tokenizer of a run, so a checkpoint can translate without the training data."""
    directory.mkdir(parents=True, exist_ok=True)
    src.save(directory)
    if tgt is not src:
        tgt.save(directory)
    write_json(directory / "codecs.json", {"src": src.state(), "tgt": tgt.state(), "shared": tgt is src})


def load_codecs(directory: Path) -> tuple[Codec, Codec]:
    meta = json.loads((directory / "codecs.json").read_text(encoding="utf-8"))
    src = codec_from_state(meta["src"], directory)
    tgt = src if meta["shared"] else codec_from_state(meta["tgt"], directory)
    return src, tgt
