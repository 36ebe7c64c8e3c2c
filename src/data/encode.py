"""Encode a corpus with its tokenizers, once: the result is cached on disk, keyed by the text, the tokenizer
settings and the code that builds the tokenizers and encodes, so the runs of a sweep (and reruns) load token ids
instead of tokenizing again, and an edit to that code never loads ids (or detokenization rules) the old code made.
A cache file written with another version of an installed tokenizer package is encoded again.

spaCy tokenizes in child processes (forked, on Linux; one per side, at once), as fairseq's ``fairseq-preprocess``
is a command of its own: importing spaCy and tokenizing Multi30k leave about 85 MB in the process that did it
(modules and interned strings, not given back by ``malloc_trim``), and the run needs neither afterwards, since
detokenizing uses the learned rules only. The run's process then holds what a cached run holds. XLM-R's tokenizer
is used in the run's process, as decoding needs it there anyway."""

from __future__ import annotations

import ast
import contextlib
import ctypes
import functools
import hashlib
import importlib.metadata
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import time
import traceback
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..errors import UserError
from ..fileio import atomic_path, locked
from ..memory import peak_rss_mb
from ..tokenizers import Codec, TrimmedCodec, build_codec, build_spacy_encoding, codec_from_state, written_specials
from .corpus import Corpus

log = logging.getLogger(__name__)

ENCODING_CODE = (Path(__file__), Path(__file__).parents[1] / "tokenizers.py")
# The packages each tokenizer type tokenizes with (tokenizer.name).
TOKENIZER_PACKAGES = {"spacy": ("spacy",), "xlmr": ("transformers", "tokenizers", "sentencepiece")}


def code_digest() -> str:
    """The encoding code as Python reads it: an edit to its comments, docstrings or layout keeps the cache (which
    took minutes for millions of pairs); any other edit, a log message's included, makes a new one. The same on
    every Python version (a GPU machine's 3.12 finds the cache a 3.11 machine made)."""
    h = hashlib.sha256()
    for path in ENCODING_CODE:
        h.update(_code_shape(path.read_text(encoding="utf-8")).encode())
    return h.hexdigest()[:16]


@functools.cache
def _code_shape(source: str) -> str:
    """A module's syntax tree without its docstrings, as text (each run of a sweep, or of the tests, in one process
    reads the same source: parsed once)."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return _shape(tree)


def _shape(node) -> str:
    """A syntax tree as text, leaving out the fields that are empty or None, which ``ast.dump`` shows by version
    (3.12 added ``type_params=[]`` to every function, 3.13 leaves the empty ones out)."""
    if isinstance(node, ast.AST):
        fields = (f"{name}={_shape(value)}" for name, value in ast.iter_fields(node) if value is not None and value != [])
        return f"{type(node).__name__}({', '.join(fields)})"
    if isinstance(node, list):
        return f"[{', '.join(map(_shape, node))}]"
    return repr(node)


def package_versions(tokenizer: dict) -> dict[str, str | None]:
    """The installed versions of the packages this tokenizer uses (None: not installed), spaCy's named pipelines
    (``tokenizer.models``, installed as packages) included."""
    versions = {}
    pipelines = (tokenizer.get("models") or {}).values() if tokenizer.get("name") == "spacy" else ()
    for name in (*TOKENIZER_PACKAGES.get(tokenizer.get("name"), ()), *sorted(pipelines)):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def changed_packages(tokenizer: dict, cached: dict) -> list[str]:
    """The installed packages of this tokenizer whose version differs from the one a cache file was written with.
    One not installed here is not counted: it could not tokenize again (a GPU machine without spaCy uses the
    encoded corpus it was given)."""
    return [f"{name} {cached.get(name)} -> {version}" for name, version in package_versions(tokenizer).items()
            if version is not None and cached.get(name) != version]


class PackedSequences(Sequence[Tensor]):
    """Token ids of many sentences end to end in one tensor; item ``i`` is a view of sentence ``i``. The ids stay
    int32 as the cache holds them (4 bytes an id); a batch is int64, as ``collate`` adds the special tokens.

    One tensor per sentence costs about 600 bytes besides its ids (the tensor, its storage, their allocations):
    Multi30k's 29,000 training pairs took 42 MB as 58,000 tensors and take 10 MB packed (measured), and a corpus
    of millions of pairs would spend gigabytes on bookkeeping. Each sentence's length and start are 8-byte integers
    in arrays, not Python ints in lists: one side of 4.5M sentences of 30 ids takes 584 MiB, and took 1,239 MiB as
    int64 ids and lists (experiments/foundation/packed_memory.py)."""

    def __init__(self, ids: Tensor, lengths: Tensor):
        self.ids = ids
        self.lengths = _int_array(lengths)
        self._starts = _int_array(torch.cumsum(lengths, 0) - lengths)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self.ids.narrow(0, self._starts[i], self.lengths[i])

    def take(self, index: Tensor) -> tuple[Tensor, Tensor]:
        """The ids of the sentences ``index`` end to end, as int64, and each one's length: a batch's ids in a few
        tensor operations, not a view per sentence (1.7 ms of host time for a batch of 16,384 tokens)."""
        lengths = torch.frombuffer(self.lengths, dtype=torch.int64)[index]
        starts = torch.frombuffer(self._starts, dtype=torch.int64)[index]
        shift = torch.repeat_interleave(starts - (torch.cumsum(lengths, 0) - lengths), lengths)
        return self.ids[torch.arange(len(shift)) + shift].long(), lengths


def _int_array(values: Tensor) -> array:
    return array("q", values.to(torch.int64).numpy().tobytes())


def seq_lengths(seqs: Sequence[Tensor]) -> list[int]:
    """Each sentence's length: PackedSequences keeps them (a view per sentence took 14 s of every run's start on a
    million pairs); a list of tensors (the first pairs of a split, an overfit set) is measured."""
    return list(seqs.lengths) if isinstance(seqs, PackedSequences) else [len(x) for x in seqs]


def length_tensor(seqs: Sequence[Tensor]) -> Tensor:
    """Each sentence's length as an int64 tensor; PackedSequences' array is copied at once (0.02 s for 4.5M
    sentences, where ``torch.tensor`` took 0.5 s reading it an element at a time)."""
    if isinstance(seqs, PackedSequences) and len(seqs):
        return torch.frombuffer(seqs.lengths, dtype=torch.int64).clone()
    return torch.tensor(seq_lengths(seqs), dtype=torch.int64)


@dataclass
class EncodedSplit:
    src: Sequence[Tensor]  # token ids per sentence, no special tokens (PackedSequences, int32; or a list)
    tgt: Sequence[Tensor]

    def __len__(self) -> int:
        return len(self.src)


@dataclass
class EncodedCorpus:
    src_codec: Codec
    tgt_codec: Codec
    splits: dict[str, EncodedSplit]
    cache_file: Path | None = None
    from_cache: bool = False
    # The larger peak RSS of the tokenizing child processes, one per side (the pages each shares with the run's
    # process counted in it too; both at once hold about the sum), or None where nothing was tokenized in a child.
    encode_peak_rss_mb: float | None = None


def tokenizer_files_digest(tokenizer: dict) -> str | None:
    """The contents of every tokenizer given as a local directory (xlmr's ``tokenizer.name_or_path``, a spaCy
    pipeline's folder in ``tokenizer.models``): the same path holding another tokenizer must not load the ids the
    earlier one made. None when there is none: a hub name or an installed package is keyed by its name and the
    packages' versions."""
    paths = [tokenizer.get("name_or_path")] if tokenizer.get("name") == "xlmr" else []
    models = tokenizer.get("models") or {}
    paths += [models[lang] for lang in sorted(models)]
    dirs = [d for d in (Path(p).expanduser() for p in paths if p) if d.is_dir()]
    if not dirs:
        return None
    h = hashlib.sha256()
    for path in dirs:
        h.update(f"\0\0{path}".encode())
        for f in sorted(p for p in path.rglob("*") if p.is_file()):
            h.update(f"\0{f.relative_to(path)}\0".encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def cache_key(corpus: Corpus, tokenizer: dict) -> str:
    langs = (corpus.src_lang, corpus.tgt_lang)
    models = tokenizer.get("models") or {}
    if isinstance(models, dict):  # spaCy pipelines of other languages change nothing here
        tokenizer = {**tokenizer, "models": {k: v for k, v in models.items() if k in langs}}
    h = hashlib.sha256()
    h.update(json.dumps({"code": code_digest(), "tokenizer": tokenizer, "langs": [corpus.src_lang, corpus.tgt_lang],
                         "tokenizer_files": tokenizer_files_digest(tokenizer), "text": corpus.digest},
                        sort_keys=True).encode())
    return h.hexdigest()[:24]


def _pack(seqs: list[list[int]]) -> dict[str, Tensor]:
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
    flat = torch.tensor([i for s in seqs for i in s], dtype=torch.int32)
    return {"ids": flat, "lengths": lengths}


def _unpack(packed: dict[str, Tensor]) -> PackedSequences:
    return PackedSequences(packed["ids"], packed["lengths"])


def encode_corpus(corpus: Corpus, tokenizer: dict, cache_dir: Path | None) -> EncodedCorpus:
    """Build the tokenizers from the training split and encode every split, or load both from the cache. Jobs that
    miss the cache together (a sweep's, started at once on a cluster) tokenize once: the first holds the cache
    file's lock while it tokenizes and writes, and the others then load its file."""
    cache_file = Path(cache_dir) / f"encoded-{cache_key(corpus, tokenizer)}.pt" if cache_dir else None
    if cache_file is None:
        return _encoded(corpus, tokenizer, None)
    if cache_file.is_file() and corpus.read_train_again is not None:  # the text's digest is the key: not held while
        corpus.let_go_of_training_text()  # the ids load (750 MB at 4.5M pairs), read again where they cannot be used
    if (cached := _cached(cache_file, tokenizer)) is not None:
        return cached
    with contextlib.suppress(OSError):  # a cache directory that cannot be made: unguarded, and not cached
        cache_file.parent.mkdir(parents=True, exist_ok=True)
    with locked(cache_file.parent / f".{cache_file.name}.lock"):
        if (cached := _cached(cache_file, tokenizer, quiet=True)) is not None:  # written while this job waited
            return cached
        for stale in cache_file.parent.glob(f".{cache_file.name}.*.tmp"):  # a writer killed mid-write left it:
            stale.unlink(missing_ok=True)  # the lock's holder is the only writer of this file
        corpus.take_back_training_text()
        return _encoded(corpus, tokenizer, cache_file)


def _cached(cache_file: Path, tokenizer: dict, quiet: bool = False) -> EncodedCorpus | None:
    """The encoded corpus of ``cache_file``, or None where there is none to use (a corrupt or outdated file is
    rebuilt, not fatal; a tokenizer that cannot be loaded is the user's error, said once). ``quiet``: a second
    look, whose reasons were logged by the first."""
    if not cache_file.is_file():
        return None
    try:
        blob = torch.load(cache_file, weights_only=True)
        changed = changed_packages(tokenizer, blob["packages"])
        if not changed:
            log.info("loaded encoded corpus from %s", cache_file)
            return _from_blob(blob, cache_file, from_cache=True)
        if not quiet:
            log.info("encoding the corpus again: %s since %s was written", ", ".join(changed), cache_file)
    except UserError:  # its tokenizer cannot be loaded (a hub name offline): encoding again would need it too
        raise
    except Exception as e:
        if not quiet:
            log.warning("ignoring unreadable cache %s (%s)", cache_file, e)
    return None


def _encoded(corpus: Corpus, tokenizer: dict, cache_file: Path | None) -> EncodedCorpus:
    """Tokenize and encode the corpus, and cache it in ``cache_file`` where given."""
    # spaCy in child processes (the module's docstring says why), except off Linux (no safe fork) and in a daemonic
    # process (a multiprocessing pool's worker), which may not start one.
    fork = tokenizer.get("name") == "spacy" and sys.platform == "linux" and not multiprocessing.current_process().daemon
    blob, child_peaks = _encode(corpus, tokenizer, fork)
    if child_peaks:
        log.info("tokenized in a child process per side, at once (peak RSS %s MB)",
                 " and ".join(f"{peak:.0f}" for peak in child_peaks))
    if cache_file is not None:
        try:
            with atomic_path(cache_file) as tmp:
                torch.save(blob, tmp)
            log.info("cached encoded corpus in %s", cache_file)
        except OSError as e:  # a read-only or full cache directory: this run goes on, the next one tokenizes again
            log.warning("could not cache the encoded corpus in %s (%s); going on without it", cache_file, e)
            cache_file = None
    return _from_blob(blob, cache_file, from_cache=False, encode_peak_rss_mb=max(child_peaks, default=None))


SIDES = ("src", "tgt")


def _encode(corpus: Corpus, tokenizer: dict, fork: bool = False) -> tuple[dict, list[float]]:
    """The codecs' states, every split's token ids, and the tokenizer packages' versions: what the cache holds; and
    the peak RSS of each child process that tokenized. With ``fork``, spaCy builds and encodes each side in a forked
    child of its own, both at once: a side's vocabulary and ids need nothing of the other's (half the time on two
    cores). XLM-R's one tokenizer encodes both sides here."""
    log.info("tokenizing %s pairs (%s) with %s: minutes for millions of pairs",
             f"{sum(map(len, corpus.splits.values())):,}", ", ".join(corpus.splits), tokenizer.get("name"))
    jobs = [(corpus, tokenizer, side) for side in SIDES]
    shared = tokenizer.get("name") == "xlmr"
    codec = build_codec(tokenizer, corpus.src_lang, corpus.train.src) if shared else None
    sides = in_forked_children(_encode_side, jobs) if fork else [(_encode_side(*job, codec), None) for job in jobs]
    (src, _), (tgt, _) = sides
    return {
        "codecs": {"src": src["codec"], "tgt": tgt["codec"], "shared": shared},
        "splits": {name: {"src": src["splits"][name], "tgt": tgt["splits"][name]} for name in corpus.splits},
        "packages": package_versions(tokenizer),
    }, [peak for _, peak in sides if peak is not None]


def _encode_side(corpus: Corpus, tokenizer: dict, side: str, codec: Codec | None = None) -> dict:
    """One side's codec and its ids in every split: spaCy's built from the side's training text in the pass that
    encodes it; XLM-R's ``codec``, shared by both sides, given."""
    lang = corpus.src_lang if side == "src" else corpus.tgt_lang
    encoded = {}
    if codec is None:
        texts = getattr(corpus.train, side)
        codec, ids, lengths = build_spacy_encoding(tokenizer, lang, texts,
                                                   SplitProgress(f"tokenizing train.{lang}", len(texts)))
        encoded["train"] = {"ids": ids, "lengths": lengths}
    return {"codec": codec.state(),
            "splits": {name: encoded.get(name) or _encode_packed(codec, getattr(split, side), f"{name}.{lang}")
                       for name, split in corpus.splits.items()}}


# Sentences encoded at a time. XLM-R's tokenizer returns Python lists: a whole split of WMT's 4.5M pairs at once
# would hold about 20 GB of them (measured: one side of 300,000 pairs peaked 1.2 GB higher than in chunks of 20,000).
ENCODE_CHUNK = 20_000
PROGRESS_EVERY_S = 30.0


class SplitProgress:
    """Says how far a long pass over a split is, every PROGRESS_EVERY_S seconds since it last said; nothing at the
    end."""

    def __init__(self, doing: str, total: int):
        self.doing, self.total = doing, total
        self.start = self.said = time.monotonic()

    def __call__(self, done: int) -> None:
        now = time.monotonic()
        if now - self.said >= PROGRESS_EVERY_S and 0 < done < self.total:
            self.said, rate = now, done / (now - self.start)
            log.info("%s: %s of %s lines, %.0f lines/s, about %.0f min left", self.doing, f"{done:,}",
                     f"{self.total:,}", rate, (self.total - done) / rate / 60)


def _encode_packed(codec: Codec, texts: Sequence[str], what: str) -> dict[str, Tensor]:
    """``texts`` encoded and packed a chunk at a time, saying how far it is every half minute on a long split, and
    once how many special tokens written in the text became ``<unk>`` (XLM-R's)."""
    parts, replaced, progress = [], 0, SplitProgress(f"encoding {what}", len(texts))
    for i in range(0, len(texts), ENCODE_CHUNK):
        ids, found = codec.encode_counting(texts[i:i + ENCODE_CHUNK])
        parts.append(_pack(ids))
        replaced += found
        progress(min(i + ENCODE_CHUNK, len(texts)))
    if replaced:
        log.warning("%s: %s", what, written_specials(replaced))
    parts = parts or [_pack([])]
    return {key: torch.cat([part[key] for part in parts]) for key in ("ids", "lengths")}


def _from_blob(blob: dict, cache_file: Path | None, **kw) -> EncodedCorpus:
    src = codec_from_state(blob["codecs"]["src"])
    tgt = src if blob["codecs"]["shared"] else codec_from_state(blob["codecs"]["tgt"])
    splits = {name: EncodedSplit(_unpack(s["src"]), _unpack(s["tgt"])) for name, s in blob["splits"].items()}
    return EncodedCorpus(src, tgt, splits, cache_file, **kw)


def die_with(parent: int) -> None:
    """Linux: the kernel ends this process when the one that forked it dies, a run killed with SIGKILL say, which
    no exit handler of the parent's sees (``PR_SET_PDEATHSIG``). Elsewhere it runs on and its result is lost."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before that
        os._exit(1)


def in_forked_children(fn: Callable, calls: list[tuple]) -> list[tuple[object, float]]:
    """``fn(*args)`` for each ``args`` of ``calls``, each in a forked child process, all at once: [(its result, the
    child's peak RSS in MB)] in the order of ``calls``. A result comes back pickled; an exception raised in a child
    is raised here (one that is not the user's to fix with the child's traceback as a note), and the other
    children are ended (SIGKILL: a handler of the parent's that ignores SIGTERM, submitit's, is not theirs either).
    A child runs torch on one thread, as a DataLoader worker does: OpenMP's threads do not survive a fork. It exits
    without running the parent's exit handlers (multiprocessing's ``os._exit``)."""
    ctx = multiprocessing.get_context("fork")
    parent = os.getpid()

    def child(args: tuple, send) -> None:
        try:
            # SIGTERM and SIGUSR2 end the child: the parent's handlers are the parent's to run (submitit's would
            # requeue the SLURM job from here too, and its SIGTERM handler ignores the signal)
            for signum in (signal.SIGTERM, signal.SIGUSR2):
                signal.signal(signum, signal.SIG_DFL)
            die_with(parent)
            torch.set_num_threads(1)
            if (hooks := sys.modules.get("wandb.sdk.lib.import_hooks")) is not None:
                # A W&B run's import telemetry (importing spaCy is noted) would talk to W&B's service, which a
                # forked process may not: wandb raises ForkedError. The run's own process keeps its hooks.
                hooks.unregister_all_post_import_hooks()
            reply = (True, fn(*args), peak_rss_mb())
        except BaseException as e:  # passed to the parent, which raises it
            if not isinstance(e, UserError):
                e.add_note(f"in the child process:\n{traceback.format_exc()}")
            reply = (False, e, 0.0)
        try:
            data = pickle.dumps(reply)
        except Exception:  # an exception that does not pickle: its text
            data = pickle.dumps((False, RuntimeError("".join(traceback.format_exception(reply[1])).strip()), 0.0))
        with contextlib.suppress(BrokenPipeError):  # the parent stopped listening: interrupted
            send.send_bytes(data)

    children, replies = [], {}  # (process, the parent's end of its pipe)
    try:  # from the start: an interrupt at any point ends the children too
        for args in calls:
            receive, send = ctx.Pipe(duplex=False)
            process = ctx.Process(target=child, args=(args, send), name=f"{fn.__name__} (child)", daemon=True)
            children.append((process, receive))
            try:
                process.start()
            finally:
                send.close()  # the child's end: EOF here when the child dies
        waiting = {receive: i for i, (_, receive) in enumerate(children)}
        while waiting:
            # Waiting in short polls, not in one blocking read: Python runs its signal handlers (Ctrl-C's
            # KeyboardInterrupt) in the main thread between them, also when the kernel delivered the signal to
            # another of the process's threads, which does not interrupt a read blocked in the main one.
            for receive in multiprocessing.connection.wait(list(waiting), timeout=0.2):
                i = waiting.pop(receive)
                try:
                    ok, value, peak = pickle.loads(receive.recv_bytes())
                except EOFError:
                    children[i][0].join()
                    raise RuntimeError(f"the child process running {fn.__name__} ended with exit code "
                                       f"{children[i][0].exitcode} before it replied (killed for memory?)") from None
                if not ok:
                    raise value
                replies[i] = (value, peak)
        for process, _ in children:
            process.join()
    finally:
        for process, receive in children:
            receive.close()
            if process.is_alive():
                process.kill()
                process.join()
    return [replies[i] for i in range(len(calls))]


def _mapped(seqs: Sequence[Tensor], table: Tensor) -> Sequence[Tensor]:
    """Every id replaced by ``table[id]``, packed sequences staying packed."""
    if isinstance(seqs, PackedSequences):
        return PackedSequences(table.to(seqs.ids.dtype)[seqs.ids], length_tensor(seqs))
    return [table[s] for s in seqs]


def trim_vocabulary(encoded: EncodedCorpus, train: EncodedSplit | None = None) -> EncodedCorpus:
    """memory=trim_vocab: keep only the ids the training split uses (and the special tokens), renumbered, so the
    embeddings and the output layer shrink; ids of held-out text outside them become ``<unk>``. A shared
    vocabulary stays shared (one set of ids from both sides). ``train``: the pairs the run trains on, if not the
    corpus's whole training split (memory=truncate's: the pieces only its cut tails or dropped pairs held are
    never trained); it is the returned corpus's training split."""

    def all_ids(seqs: Sequence[Tensor]) -> Tensor:
        return seqs.ids if isinstance(seqs, PackedSequences) else torch.cat(list(seqs))

    def trimmed(codec: Codec, sides: list[Sequence[Tensor]]) -> TrimmedCodec:
        used = torch.cat([all_ids(seqs) for seqs in sides if len(seqs)]).unique().tolist()
        return TrimmedCodec(codec, [*used, codec.bos_id, codec.pad_id, codec.eos_id, codec.unk_id])

    train = encoded.splits["train"] if train is None else train
    if encoded.src_codec is encoded.tgt_codec:
        src = tgt = trimmed(encoded.src_codec, [train.src, train.tgt])
    else:
        src, tgt = trimmed(encoded.src_codec, [train.src]), trimmed(encoded.tgt_codec, [train.tgt])
    src_table, tgt_table = torch.tensor(src.lookup_table()), torch.tensor(tgt.lookup_table())
    splits = {name: EncodedSplit(_mapped(split.src, src_table), _mapped(split.tgt, tgt_table))
              for name, split in {**encoded.splits, "train": train}.items()}
    return EncodedCorpus(src, tgt, splits, encoded.cache_file, encoded.from_cache)
