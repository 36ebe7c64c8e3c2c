"""Translate a file with a trained checkpoint (or the average of several), and score it when a reference is given.

    python translate.py outputs/runs/<date>/<time>/checkpoints/best.pt --input test.de \
        [--reference test.en] [--output hyp.en] [--beam-size 4 --length-penalty 0.6]
    python translate.py outputs/runs/<date>/<time>/checkpoints/step_*.pt --input test.de   # weights averaged
    echo "Ein Hund läuft." | python translate.py outputs/runs/<date>/<time>     # a run: what it tested with

Reads one sentence per line (plain or .gz; standard input without --input or with --input -); writes one
translation per line (stdout without --output). It decodes as the run did (beam size, length penalty, length caps,
autocast and fp32 matrix-product precision from the checkpoint's config, so that it reproduces the run's
test.hyp.txt) unless told otherwise. With --reference, prints sacreBLEU corpus BLEU and chrF of the detokenized
output, with their signatures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from src.data.corpus import check_line_counts, read_lines
from src.errors import UserError
from src.fileio import write_text


def arguments() -> argparse.ArgumentParser:
    """The command's flags. Their choices are written out, as importing the modules that hold them imports torch
    (seconds), and --help answers at once; a test checks them against ``src.memory`` and ``src.kernels``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("checkpoint", nargs="+", help="a checkpoint written by train.py (checkpoints/best.pt or "
                   "checkpoints/step_<N>.pt; a run directory: what it tested with, best.pt or its last N averaged), "
                   "or several of one run: their weights are averaged")
    p.add_argument("--input", default="-", help="source sentences, one per line (default, or -: standard input)")
    p.add_argument("--reference", help="reference translations, line for line: prints BLEU and chrF")
    p.add_argument("--output", help="where to write the translations (default, or -: standard output)")
    p.add_argument("--tokenizer", help="the run's tokenizer directory (default: <run>/tokenizer)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--batch-size", type=int, help="sentences decoded together (default: the run's "
                   "trainer.eval_batch_size; under autocast another batch rounds otherwise)")
    p.add_argument("--beam-size", type=int, help="1: greedy decoding (default: the run's trainer.beam_size)")
    p.add_argument("--length-penalty", type=float, help="with beams: GNMT's alpha, 0: none (default: the run's)")
    p.add_argument("--max-len-a", type=float, help="a translation stops at max_len_a x its source's length + "
                   "max_len_b tokens (default: the run's)")
    p.add_argument("--max-len-b", type=int, help="see --max-len-a (default: the run's)")
    p.add_argument("--max-positions", type=int, help="the longest source accepted, in tokens with the special "
                   "token; 0: any (default: the run's model.max_positions)")
    p.add_argument("--amp", choices=["none", "bf16", "fp16"], help="autocast while decoding (default: the run's "
                   "memory.amp)")
    p.add_argument("--matmul-precision", choices=["highest", "high", "medium"], help="fp32 matrix products: "
                   "highest (fp32), high (TF32 on a GPU of compute capability 8.0 or later), medium (bf16 inside "
                   "them) (default: the run's trainer.matmul_precision)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = arguments()
    args = p.parse_args(argv)
    for flag, value, least in (("--beam-size", args.beam_size, 1), ("--batch-size", args.batch_size, 1),
                               ("--length-penalty", args.length_penalty, 0), ("--max-len-a", args.max_len_a, 0),
                               ("--max-len-b", args.max_len_b, 1), ("--max-positions", args.max_positions, 0)):
        if value is not None and value < least:
            p.error(f"{flag} {value}: must be >= {least}")
    to_stdout = args.output in (None, "-")
    # torch and the modules that import it, once the arguments are good: --help and a bad flag answer at once
    from src.checkpoint import checkpoint_files, load_translator
    from src.evaluate import score
    from src.settings import resolve_device

    try:
        if not to_stdout:
            check_output(args)
        device = resolve_device(args.device, key="--device ")
        files = [f for p in args.checkpoint for f in checkpoint_files(Path(p).expanduser().resolve())]
        # the text before the model: a missing or mismatched file is said before seconds of loading a checkpoint
        sources, references = read_text(args)
        model, src_codec, tgt_codec, ckpt = load_translator(files, device, args.tokenizer)
        print("checkpoints: " + ", ".join(map(str, files)) + (" (weights averaged)" if len(files) > 1 else ""),
              file=sys.stderr)
        decoding = run_decoding(ckpt, args)
        print("decoding: " + ", ".join(f"{k} {'none' if v is None else v}" for k, v in decoding.items()), file=sys.stderr)
        hyps = decode(model, sources, src_codec, tgt_codec, device, decoding, args.max_positions,
                      source_name="standard input" if args.input == "-" else args.input)
        text = "".join(h + "\n" for h in hyps)
        if not to_stdout:
            try:
                write_text(args.output, text)
            except OSError as e:
                raise UserError(f"--output {args.output}: cannot write ({e.strerror or e})") from None
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if to_stdout:  # UTF-8, as the input and the corpus files are, whatever the locale (a latin-1 one raised on ⁇)
        with contextlib.suppress(AttributeError, ValueError):  # a stream that cannot be reconfigured: as it is
            sys.stdout.reconfigure(encoding="utf-8")
        sys.stdout.write(text)
    if references is not None:
        tgt_lang = (ckpt.get("config") or {}).get("data", {}).get("tgt_lang")
        print(json.dumps(score(hyps, references, tgt_codec.lowercase, tgt_lang)),
              file=sys.stderr if to_stdout else sys.stdout)
    return 0


def check_output(args: argparse.Namespace) -> None:
    """--output's problems, said before decoding, not after: a directory, or the --input or --reference file."""
    if Path(args.output).is_dir():
        raise UserError(f"--output {args.output}: is a directory; name a file (or - for standard output)")
    for flag, path in (("--input", args.input), ("--reference", args.reference)):
        if (path not in (None, "-") and Path(path).exists() and Path(args.output).exists()
                and Path(path).samefile(args.output)):
            raise UserError(f"--output {args.output}: is the {flag} file; the translations would replace it")


def read_text(args: argparse.Namespace) -> tuple[list[str], list[str] | None]:
    """--input's sentences and --reference's, line for line (None without one); empty references are warned of."""
    if args.input == "-" and sys.stdin.isatty():  # typed at a terminal: say what it waits for
        print("reading sentences from standard input, one per line; end with Ctrl-D", file=sys.stderr)
    sources = read_lines(args.input, blank_ok=True)
    if not args.reference:
        return sources, None
    references = read_lines(args.reference)
    check_line_counts("standard input" if args.input == "-" else args.input, sources, args.reference, references)
    if blank := [i for i, r in enumerate(references, 1) if not r.strip()]:
        print(f"warning: {args.reference}: {len(blank)} empty reference line(s) (the first: line {blank[0]}), "
              "each scored as a reference of no words", file=sys.stderr)
    return sources, references


def translate_lines(checkpoint, sentences: list[str], device: str = "auto", tokenizer: str | None = None,
                    max_positions: int | None = None, **flags) -> list[str]:
    """This command from Python (a notebook): the translations of ``sentences`` by ``checkpoint`` (a checkpoint
    file, several of one run, averaged, or a run directory: what it tested with), decoded as the run did unless
    ``flags`` say otherwise (``beam_size``, ``length_penalty``, ``max_len_a``, ``max_len_b``, ``batch_size``,
    ``matmul_precision``, ``amp``: the command's flags)."""
    from src.checkpoint import load_translator
    from src.settings import resolve_device

    if unknown := set(flags) - {*DECODING_DEFAULTS, "amp"}:
        raise TypeError(f"translate_lines: unknown decoding setting(s) {', '.join(sorted(unknown))}; expected "
                        f"{', '.join([*DECODING_DEFAULTS, 'amp'])}")
    device = resolve_device(device, key="device ")
    model, src_codec, tgt_codec, ckpt = load_translator(checkpoint, device, tokenizer)
    return decode(model, sentences, src_codec, tgt_codec, device, run_decoding(ckpt, argparse.Namespace(**flags)),
                  max_positions)


def decode(model, sentences: list[str], src_codec, tgt_codec, device, decoding: dict, max_positions: int | None,
           source_name: str = "input") -> list[str]:
    """The translations of ``sentences`` with the ``decoding`` settings (``run_decoding``); a blank line's is
    empty."""
    import torch

    from src.evaluate import translate
    from src.kernels import matmul_precision
    from src.memory import MemoryStrategy

    with torch.inference_mode(), matmul_precision(decoding["matmul_precision"]):
        return translate(model, sentences, src_codec, tgt_codec, device, source_name=source_name,
                         max_positions=max_positions, batch_size=decoding["batch_size"],
                         beam_size=decoding["beam_size"], alpha=decoding["length_penalty"],
                         max_len_a=decoding["max_len_a"], max_len_b=decoding["max_len_b"],
                         autocast=lambda: MemoryStrategy(amp=decoding["amp"]).autocast(device))


DECODING_DEFAULTS = {"beam_size": 1, "length_penalty": 0.6, "max_len_a": 1.5, "max_len_b": 10, "batch_size": 128,
                     "matmul_precision": "highest"}


def run_decoding(ckpt: dict, args: argparse.Namespace | None = None) -> dict:
    """The decoding settings: the flags given (none without ``args``), else the run's own (its trainer config and
    memory strategy in the checkpoint), else the config's defaults."""
    config = ckpt.get("config") or {}
    run = config.get("trainer") or {}
    in_run = {"batch_size": "eval_batch_size"}  # the run's key where its name differs
    decoding = {key: next(v for v in (getattr(args, key, None), run.get(in_run.get(key, key)), default) if v is not None)
                for key, default in DECODING_DEFAULTS.items()}
    # the strategy the run trained and evaluated with: memory=auto's choice (amp, say) is not in its config
    strategy = ckpt.get("strategy") or {"amp": (config.get("memory") or {}).get("amp")}
    amp = getattr(args, "amp", None) or strategy.get("amp")
    decoding["amp"] = None if amp == "none" else amp
    return decoding


if __name__ == "__main__":
    sys.exit(main())
