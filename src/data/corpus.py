"""Parallel corpora as raw sentence pairs (a training split read from files is packed: ``PackedLines``): the
synthetic grammar, Multi30k, or any plain files.

Every reader checks what it reads and fails with one line naming the file (and line) when the data is bad:
a missing or empty file, parallel files whose line counts differ, or text that is not UTF-8. The reader of
``data=files`` (``load_files``), and Multi30k's from a local copy (``data.root``), read every file before they
fail, and the error has one such line for each bad file, so one attempt shows them all; Multi30k's downloads stop
at the first that fails (each is retried first).
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import http.client
import io
import logging
import sys
import time
import urllib.error
import urllib.request
import zlib
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import TypeVar

from ..errors import ConfigError, DataError, check_int, check_number
from ..fileio import atomic_path
from .synthetic import LengthDistribution, generate_corpus

log = logging.getLogger(__name__)

SPLITS = ("train", "valid", "test")
T = TypeVar("T")


class PackedLines(Sequence[str]):
    """Lines of text held as one UTF-8 buffer, joined by newlines, and each line's start: a training side of
    millions of sentences in about its file's size, where a list of ``str`` took about twice that (an object of
    49 bytes or more per line; experiments/foundation). Read as a list of ``str`` is (an index or a slice gives
    ``str``), not written."""

    def __init__(self, lines: Iterable[str]):
        text, starts = bytearray(), array("q")
        for line in lines:
            if starts:
                text += b"\n"
            starts.append(len(text))
            text += line.encode()
        starts.append(len(text) + 1)  # where a line after the last would start, past its newline
        self._text, self._starts = text, starts

    def __len__(self) -> int:
        return len(self._starts) - 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError("PackedLines index out of range")
        return self._text[self._starts[i]:self._starts[i + 1] - 1].decode()

    def __iter__(self) -> Iterator[str]:
        text, starts = self._text, self._starts
        for i in range(len(self)):
            yield text[starts[i]:starts[i + 1] - 1].decode()

    def __eq__(self, other) -> bool:
        return isinstance(other, PackedLines | list) and len(self) == len(other) and all(
            a == b for a, b in zip(self, other, strict=True))

    def __repr__(self) -> str:
        return f"PackedLines({len(self):,} lines, {len(self._text):,} bytes)"

    def joined(self) -> bytes | bytearray:
        """``"\\n".join(lines).encode()``, without making a ``str`` of each line."""
        return self._text


class LetGo(Sequence[str]):
    """A training side whose text was let go once encoded (``Corpus.let_go_of_training_text``): its number of
    lines, and an error where it is read."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        raise RuntimeError("the training text was let go once encoded (Corpus.let_go_of_training_text)")


@dataclass
class ParallelText:
    src: Sequence[str]
    tgt: Sequence[str]
    # Each pair's line in its files (from 1), where pairs were left out (empty sides); None: pair i is line i + 1.
    lines: list[int] | None = None

    def __post_init__(self):
        assert len(self.src) == len(self.tgt)

    def __len__(self) -> int:
        return len(self.src)


@dataclass
class Corpus:
    src_lang: str
    tgt_lang: str
    splits: dict[str, ParallelText]
    # What identifies the text, for cache keys and the run summary (e.g. file paths and checksums).
    description: dict = field(default_factory=dict)
    # Reads the training split from its files again; None for a generated corpus, whose text is always held.
    read_train_again: Callable[[], ParallelText] | None = field(default=None, repr=False, compare=False)

    @property
    def train(self) -> ParallelText:
        return self.splits["train"]

    @functools.cached_property
    def digest(self) -> str:
        """SHA-256 of the text of every split, both sides (24 hex digits): two runs with the same digest read the
        same sentences, wherever the files were (the encoding cache's key, and the run summary's ``data.digest``)."""
        h = hashlib.sha256()
        for name in sorted(self.splits):
            split = self.splits[name]
            h.update(f"\0{name}\0{len(split)}".encode())
            for side in (split.src, split.tgt):
                text = side.joined() if isinstance(side, PackedLines) else "\n".join(side).encode()
                h.update(len(text).to_bytes(8, "little"))  # each side's length first: no text moves across the border
                h.update(text)
        return h.hexdigest()[:24]

    def let_go_of_training_text(self) -> None:
        """Once encoded, the training sentences are read no more (hundreds of MB at millions of pairs, in each
        process): let go, keeping the digest of the text and each pair's line in its files (``where``)."""
        self.digest  # noqa: B018 (computed from the text first, where a run without a cache has not yet)
        train = self.splits["train"]
        self.splits["train"] = ParallelText(LetGo(len(train)), LetGo(len(train)), train.lines)

    @property
    def holds_training_text(self) -> bool:
        return not isinstance(self.train.src, LetGo)

    def take_back_training_text(self) -> None:
        """The training text let go read again from its files (an encoding cache that turned out to be stale needs
        it); refused where the files changed after the digest, the cache's key, was taken from them."""
        if self.holds_training_text:
            return
        digest = self.digest
        self.splits["train"] = self.read_train_again()
        del self.digest  # (functools.cached_property: taken again, from the text read now)
        if self.digest != digest:
            paths = self.description.get("train")
            raise DataError(f"{', '.join(paths) if isinstance(paths, list) else 'the training files'}: changed while "
                            "this run read them; run it again once they are written")

    def where(self, split: str, i: int, side: int = 0) -> str:
        """Where pair ``i`` of ``split`` is: its file's line (source, or target: ``side`` 1), or its number in a
        generated split."""
        text, paths = self.splits[split], self.description.get(split)
        if isinstance(paths, list):
            return f"{paths[side]}:{text.lines[i] if text.lines else i + 1}"
        return f"{split} pair {i + 1} ({self.description.get('name', 'generated')})"


def check_data(data: dict) -> None:
    """The data group's settings, before anything is read or generated: sizes and lengths of the synthetic
    corpus, and where Multi30k comes from (the files' own problems are found as they are read)."""
    for key in ("src_lang", "tgt_lang"):
        if not isinstance(data.get(key), str):
            raise ConfigError(f"data.{key}={data.get(key)}: expected a language code, e.g. de")
    checks = {"synthetic": _check_synthetic, "multi30k": _check_multi30k, "files": _check_files}
    name = data.get("name")
    if not isinstance(name, str) or name not in checks:  # (a list is not hashable)
        raise ConfigError(f"data.name={name!r}: expected synthetic, multi30k or files")
    checks[name](data)


def _check_synthetic(data: dict) -> None:
    for split in SPLITS:
        check_int(f"data.{split}_size", data.get(f"{split}_size"), 1)
    check_int("data.seed", data.get("seed"), 0)
    for key in ("max_clauses", "long_clauses"):
        check_int(f"data.{key}", data.get(key), 1)
    check_number("data.continue_prob", data.get("continue_prob"), 0, below=1)
    check_number("data.long_fraction", data.get("long_fraction"), 0)  # at most 1: LengthDistribution says so


def _check_multi30k(data: dict) -> None:
    if data.get("root") == "":  # the default reads MULTI30K_ROOT, which may be set to nothing
        raise ConfigError("data.root is empty (MULTI30K_ROOT set to nothing?): set it to the folder of the "
                          "Multi30k raw files, or to null to download them")
    root = data.get("root")
    if root is not None and not isinstance(root, str):  # data.root=2016: Hydra reads a number
        raise ConfigError(f"data.root={root}: expected a folder path; quote one made of digits: "
                          f"'data.root=\"{root}\"'")
    url = data.get("url")
    if url is not None and not (isinstance(url, str) and url.startswith(("http://", "https://", "file://"))):
        raise ConfigError(f"data.url={url}: expected an http://, https:// or file:// address; a folder of the "
                          "raw files is data.root")


def _check_files(data: dict) -> None:
    for split in SPLITS:
        prefix = data.get(f"{split}_prefix")
        if prefix is not None and not isinstance(prefix, str):
            raise ConfigError(f"data.{split}_prefix={prefix}: expected a path prefix, e.g. /data/wmt/{split}")


def read_lines(path: str | Path, blank_ok: bool = False) -> list[str]:
    """Lines of a UTF-8 text file, plain or gzip-compressed (``-``: standard input), without line endings (``\\n``
    or ``\\r\\n``) and without a byte-order mark. A file of blank lines only is empty, unless ``blank_ok``
    (translate.py's input: a blank line is an empty translation)."""
    return list(iter_lines(path, blank_ok))


def iter_lines(path: str | Path, blank_ok: bool = False) -> Iterator[str]:
    """``read_lines``'s lines one at a time, from the file's bytes: a corpus's training side is packed as it is
    read, without a decoded copy of the whole file or a list of its lines beside the bytes (a peak of 2 times the
    file's size, against 4 with both; experiments/foundation). The file's problems are found before the first line
    is given, but for one line's invalid UTF-8, found at that line."""
    path, raw = _read_bytes(path)
    raw = _checked_text_bytes(path, raw, blank_ok)
    cr = b"\r" in raw
    mac = cr and b"\n" not in raw and (raw.count(b"\r") > 1 or raw.endswith(b"\r"))  # lines ended with \r alone
    stray = []  # the lines holding a carriage return, from 1
    for number, line in enumerate(io.BytesIO(raw), 1):  # (BytesIO reads the bytes as they are: no copy)
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{path}:{number}: invalid UTF-8 (byte {line[e.start]:#04x}); convert the file to "
                            "UTF-8") from None
        text = text.removesuffix("\n")
        if text.endswith("\r") or text.startswith("\ufeff"):  # a BOM of files put end to end
            text = text.removesuffix("\r").removeprefix("\ufeff")
        if cr and "\r" in text:
            if mac:
                raise DataError(f"{path}:1: a carriage return inside the line (old Mac line endings?); convert the "
                                "file to \\n line endings")
            # a stray one in a line, as web-crawled corpora have: whitespace, as BLEU's tokenizer would take it
            stray.append(number)
            text = text.replace("\r", " ")
        yield text
    if stray:
        log.warning("%s: %d line(s) hold a carriage return (the first: line %d); read as a space", path, len(stray),
                    stray[0])


def _read_bytes(path: str | Path) -> tuple[str | Path, bytes]:
    """A file's bytes, decompressed where its name ends in .gz, and the name to give it in errors (``-``: standard
    input)."""
    if str(path) == "-":
        path, raw = "<stdin>", sys.stdin.buffer.read()
    else:
        path = Path(path)
        if not path.exists():
            raise DataError(f"{path}: file not found")
        if path.is_dir():  # a pipe is read like a file: translate.py --input <(zcat test.de.gz | head)
            raise DataError(f"{path}: is a directory; give a text file, one sentence per line")
        opener = gzip.open if path.suffix == ".gz" else open
        try:
            with opener(path, "rb") as f:
                raw = f.read()
        except (OSError, EOFError, zlib.error) as e:  # zlib.error: a damaged compressed stream
            raise DataError(f"{path}: cannot read ({e})") from None
    return path, raw


def _checked_text_bytes(path: str | Path, raw: bytes, blank_ok: bool) -> bytes:
    """``raw`` without a byte-order mark, refused where it is not UTF-8 text: gzip data, UTF-16, NUL bytes, or
    nothing (but blank lines where ``blank_ok``)."""
    if raw.startswith(b"\x1f\x8b"):  # gzip's magic number: compressed, without the .gz name that says so
        raise DataError(f"{path}: gzip-compressed data; name the file with .gz, or decompress it (gunzip)")
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    if not raw.strip() and not blank_ok:
        raise DataError(f"{path}: file is empty")
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")) or raw.count(b"\x00") > len(raw) // 4:  # a BOM, or every other
        raise DataError(f"{path}: looks like UTF-16, not UTF-8; convert the file to UTF-8")  # byte NUL (Latin text)
    if (nul := raw.find(b"\x00")) >= 0:  # text has none; UTF-16 of other scripts decodes as "valid" UTF-8
        line = raw.count(b"\n", 0, nul) + 1
        raise DataError(f"{path}:{line}: a NUL byte, which text does not hold (UTF-16? binary?); convert the file "
                        "to UTF-8 text")
    return raw


def every_problem(calls: list[Callable[[], T]]) -> list[T]:
    """The results of ``calls``, all of them made: where any fails, one ``DataError`` whose lines are every
    failure's, in order."""
    results, problems = [], []
    for call in calls:
        try:
            results.append(call())
        except DataError as e:
            problems.append(str(e))
    if problems:
        raise DataError("\n".join(problems))
    return results


def check_line_counts(src_path: str | Path, src: Sequence[str], tgt_path: str | Path, tgt: Sequence[str]) -> None:
    """Parallel lines, line for line; blank lines at the end of the longer file are named as such."""
    if len(src) != len(tgt):
        longer_path, longer = (src_path, src) if len(src) > len(tgt) else (tgt_path, tgt)
        extra = longer[min(len(src), len(tgt)):]
        blank = "" if any(line.strip() for line in extra) else (
            f" (the last {len(extra)} line(s) of {longer_path} are empty: blank lines at its end?)")
        raise DataError(
            f"{src_path} has {len(src)} lines but {tgt_path} has {len(tgt)}{blank}; "
            "parallel files must have one sentence per line, line for line"
        )


def read_parallel(src_path: str | Path, tgt_path: str | Path, held_out: bool = False) -> ParallelText:
    """Line pairs of two parallel files, each line stripped of surrounding whitespace. Pairs with an empty side are
    skipped from training data (with a warning naming the lines) and kept in a ``held_out`` split, which is scored
    whole: an empty source has an empty translation, an empty reference is scored as one, as translate.py
    translates and scores such files. A training split's sides are ``PackedLines``, each packed as it is read."""
    (src, src_empty), (tgt, tgt_empty) = every_problem(
        [partial(_read_side, path, packed=not held_out) for path in (src_path, tgt_path)])
    check_line_counts(src_path, src, tgt_path, tgt)
    if not (src_empty or tgt_empty):
        return ParallelText(src, tgt)
    dropped = set(src_empty) | set(tgt_empty)
    if len(dropped) == len(src):
        raise DataError(f"{src_path}, {tgt_path}: every line pair has an empty side")
    where = [f"{path} has {len(lines)} empty, at line{'s' if len(lines) > 1 else ''} "
             + ", ".join(map(str, lines[:5])) + (", ..." if len(lines) > 5 else "")
             for path, lines in ((src_path, src_empty), (tgt_path, tgt_empty)) if lines]
    log.warning("%s %d line pairs with an empty side: %s", "kept (a held-out split is scored whole)" if held_out
                else "skipped", len(dropped), "; ".join(where))
    if held_out:
        return ParallelText(src, tgt)
    kept = [i for i in range(1, len(src) + 1) if i not in dropped]
    return ParallelText(PackedLines(src[i - 1] for i in kept), PackedLines(tgt[i - 1] for i in kept), kept)


def _read_side(path: str | Path, packed: bool) -> tuple[Sequence[str], list[int]]:
    """One side's lines, stripped (``packed``: as ``PackedLines``, packed as they are read), and those that are
    empty (from 1). Said where most lines hold a tab."""
    tabbed, empty = 0, []

    def stripped() -> Iterator[str]:
        nonlocal tabbed
        for number, line in enumerate(iter_lines(path), 1):
            line = line.strip()
            tabbed += "\t" in line  # (stripped: not a trailing one)
            if not line:
                empty.append(number)
            yield line

    lines = PackedLines(stripped()) if packed else list(stripped())
    if tabbed > len(lines) / 2:
        log.warning("%s: %d of %d lines hold a tab: a tab-separated file of both languages? This reads one "
                    "language per file, line for line with the other's", path, tabbed, len(lines))
    return lines, empty


def find_text_file(prefix: str | Path, lang: str) -> Path:
    """``{prefix}.{lang}``, or its gzip-compressed ``{prefix}.{lang}.gz``."""
    plain = Path(f"{prefix}.{lang}").expanduser()
    found = [candidate for candidate in (plain, Path(f"{plain}.gz")) if candidate.is_file()]
    if len(found) == 2:  # (an unzipped copy beside its archive, edited since, say)
        raise DataError(f"{plain} and {plain.name}.gz are both there; remove or rename the one not to read")
    if found:
        return found[0]
    if plain.is_dir():
        raise DataError(f"{plain}: is a directory; give the path prefix of text files, one sentence per line")
    raise DataError(f"{plain}: file not found (nor {plain.name}.gz)")


def load_files(prefixes: dict[str, str], src_lang: str, tgt_lang: str) -> Corpus:
    """Any parallel corpus laid out fairseq-style: ``{prefix}.{lang}`` (or ``.gz``) per split."""

    def read_split(split: str) -> tuple[list[str], ParallelText]:
        prefix = prefixes.get(split)
        if not prefix:
            raise DataError(f"data.{split}_prefix is not set: give the path prefix of the {split} files")
        paths = every_problem([partial(find_text_file, prefix, lang) for lang in (src_lang, tgt_lang)])
        return [str(p.resolve()) for p in paths], read_parallel(*paths, held_out=split != "train")

    read = dict(zip(SPLITS, every_problem([partial(read_split, split) for split in SPLITS])))
    description = {split: paths for split, (paths, _) in read.items()}
    return Corpus(src_lang, tgt_lang, {split: text for split, (_, text) in read.items()},
                  {"name": "files", **description}, partial(read_parallel, *description["train"]))


# ----------------------------------------------------------------------------------------------- Multi30k

MULTI30K_URL = "https://raw.githubusercontent.com/multi30k/dataset/a3d2e0d26b56f3846f66a952536ffed4e401d05a/data/task1/raw"
MULTI30K_SPLITS = {"train": "train", "valid": "val", "test": "test_2016_flickr"}
MULTI30K_LANGS = ("de", "en", "fr", "cs")
# SHA-256 of the official task-1 raw files (multi30k/dataset, data/task1/raw).
MULTI30K_SHA256 = {
    "train.de.gz": "726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6",
    "train.en.gz": "d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f",
    "train.fr.gz": "622e75069e9f4c577425c4f277116ce66e63a2401c0a2312d90073cb12379a3c",
    "train.cs.gz": "a65adb8b32e3bc664f21ecba7a6e7f6950fd1f405e135f7c312faabdb6255077",
    "val.de.gz": "f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a",
    "val.en.gz": "14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28",
    "val.fr.gz": "ca3106f1a72390591d25f6c45cb4cd39dec4cd3f123e099748a3ce5256c160e9",
    "val.cs.gz": "b63226e05c4bd5dd6a42897d74b86a1b9d2c31498252c572b1ea7f7996927fcc",
    "test_2016_flickr.de.gz": "9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8",
    "test_2016_flickr.en.gz": "611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9",
    "test_2016_flickr.fr.gz": "6d326e188d259fb1d04ac19eae3af956559b3a0b93d7635e56c90987c40c8b90",
    "test_2016_flickr.cs.gz": "200a4a74cc9560f051924abb9803be008d1908d77f747e9141aeb86dfd2797f1",
}


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def download(url: str, dest: Path, expected_sha256: str, timeout: float = 30.0, attempts: int = 3,
             backoff_s: float = 0.5) -> Path:
    """Fetch ``url`` into ``dest`` and check its SHA-256. A failed or corrupt transfer is started again, up to
    ``attempts`` times, waiting ``backoff_s`` and then twice as long each time; a partial file never takes the
    place of ``dest`` (written beside it, renamed only once complete and checked)."""
    for attempt in range(1, attempts + 1):
        try:
            with atomic_path(dest) as tmp:
                with urllib.request.urlopen(url, timeout=timeout) as response, open(tmp, "wb") as out:
                    while chunk := response.read(1 << 20):
                        out.write(chunk)
                    length = response.headers.get("Content-Length", "")  # a connection dropped mid-body
                    if length.isdigit() and out.tell() != int(length):
                        raise OSError(f"transfer cut short: {out.tell():,} of {int(length):,} bytes")
                got = sha256(tmp)
                if got != expected_sha256:
                    raise _Corrupt(f"{url}: SHA-256 {got} does not match the expected {expected_sha256}; not used")
            return dest
        except (urllib.error.URLError, OSError, http.client.HTTPException, _Corrupt) as e:  # a body cut short too
            # 404 stays 404; 408 (timeout) and 429 (too many requests: GitHub's rate limit) pass, as 5xx do
            http_code = e.code if isinstance(e, urllib.error.HTTPError) else None
            permanent = http_code is not None and http_code < 500 and http_code not in (408, 429)
            if permanent or attempt == attempts:
                problem = str(e) if isinstance(e, _Corrupt) else f"cannot download {url} ({getattr(e, 'reason', e)})"
                raise DataError(f"{problem}; {LOCAL_COPY_HINT}") from None
            wait = backoff_s * 2 ** (attempt - 1)
            after = e.headers.get("Retry-After", "") if http_code else ""  # the server's own wait, in seconds
            wait = max(wait, min(float(after), 120.0)) if after.isdigit() else wait
            log.warning("download of %s failed (%s); trying again in %.1f s", url, getattr(e, "reason", e), wait)
            time.sleep(wait)
    raise AssertionError("unreachable")


class _Corrupt(Exception):
    pass


LOCAL_COPY_HINT = ("to use a local copy instead, point data.root at a folder holding the Multi30k raw files "
                   "(train.de.gz, val.de.gz, test_2016_flickr.de.gz, ...)")


def multi30k_file(filename: str, root: str | Path | None, cache_dir: Path, url: str, download_ok: bool = True) -> Path:
    if root is not None:  # a local copy: used as is (plain or gzip-compressed), said where it is not the official
        root = Path(root).expanduser()  # a directory: load_multi30k checked
        for candidate in (root / filename, root / filename.removesuffix(".gz")):
            if candidate.is_file():
                if candidate.name == filename and sha256(candidate) != MULTI30K_SHA256[filename]:
                    log.warning("%s: not the official Multi30k file (its SHA-256 differs): scores compare with "
                                "those of runs on this copy only", candidate)
                return candidate
        raise DataError(f"{root / filename}: file not found; data.root must hold the Multi30k task-1 raw files")
    cached = cache_dir / "multi30k" / filename
    if cached.is_file() and sha256(cached) == MULTI30K_SHA256[filename]:
        return cached
    if not download_ok:
        raise DataError(f"{filename}: not in the cache ({cached.parent}) and nothing is downloaded here; "
                        "set data.root (or MULTI30K_ROOT) to a local copy")
    log.info("downloading %s/%s", url, filename)
    return download(f"{url}/{filename}", cached, MULTI30K_SHA256[filename])


def load_multi30k(src_lang: str, tgt_lang: str, root: str | Path | None, cache_dir: Path, url: str = MULTI30K_URL,
                  download_ok: bool = True) -> Corpus:
    """Multi30k task 1 (Elliott et al., 2016): train (29,000), val (1,014) and test_2016_flickr (1,000)."""
    for key, lang in (("data.src_lang", src_lang), ("data.tgt_lang", tgt_lang)):
        if lang not in MULTI30K_LANGS:
            raise DataError(f"{key}={lang}: Multi30k task 1 has {', '.join(MULTI30K_LANGS)}")
    if root is not None and not Path(root).expanduser().is_dir():
        raise DataError(f"data.root={root}: no such directory; it should hold the Multi30k raw files")
    # a local copy's bad files are all named at once; downloads stop at the first that fails (each one retries)
    collect = every_problem if root is not None else (lambda calls: [call() for call in calls])

    def split(stem: str) -> tuple[ParallelText, list[Path]]:
        paths = collect([partial(multi30k_file, f"{stem}.{lang}.gz", root, cache_dir, url, download_ok)
                         for lang in (src_lang, tgt_lang)])
        return read_parallel(*paths, held_out=stem != MULTI30K_SPLITS["train"]), paths

    read = collect([partial(split, stem) for stem in MULTI30K_SPLITS.values()])
    description = {"name": "multi30k", **{name: [str(p.resolve()) for p in paths]
                                          for name, (_, paths) in zip(MULTI30K_SPLITS, read)}}
    return Corpus(src_lang, tgt_lang, {name: text for name, (text, _) in zip(MULTI30K_SPLITS, read)}, description,
                  partial(read_parallel, *description["train"]))


# ---------------------------------------------------------------------------------------------- synthetic


def load_synthetic(
    src_lang: str, tgt_lang: str, sizes: dict[str, int], seed: int, lengths: LengthDistribution
) -> Corpus:
    if {src_lang, tgt_lang} != {"en", "de"}:
        raise DataError(f"data=synthetic translates between en and de; got {src_lang}->{tgt_lang}")
    for split in SPLITS:
        if sizes.get(split, 0) < 1:
            raise DataError(f"data.{split}_size must be >= 1, got {sizes.get(split)}")
    pairs = generate_corpus({s: sizes[s] for s in SPLITS}, seed, lengths)
    splits = {}
    for split, rows in pairs.items():
        en, de = [r[0] for r in rows], [r[1] for r in rows]
        splits[split] = ParallelText(en, de) if src_lang == "en" else ParallelText(de, en)
    description = {"name": "synthetic", "seed": seed, "sizes": sizes, "lengths": asdict(lengths)}
    return Corpus(src_lang, tgt_lang, splits, description)
