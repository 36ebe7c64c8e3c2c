"""Translate a file with a trained checkpoint (or the average of several), and score it when a reference is given.

    python translate.py outputs/runs/<date>/<time>/checkpoints/best.pt --input test.de \
        [--reference test.en] [--output hyp.en] [--beam-size 4 --length-penalty 0.6]
    python translate.py outputs/runs/<date>/<time>/checkpoints/step_*.pt --input test.de   # weights averaged
    echo "Ein Hund läuft." | python translate.py outputs/runs/<date>/<time>     # a run directory: its best.pt

Reads one sentence per line (plain or .gz; standard input without --input or with --input -); writes one
translation per line (stdout without --output). With
--reference, prints sacreBLEU corpus BLEU and chrF of the detokenized output, with their signatures.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from src.checkpoint import load_translator
from src.data.corpus import read_lines
from src.errors import UserError
from src.evaluate import score, translate
from src.fileio import atomic_path
from src.run import resolve_device


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("checkpoint", nargs="+", help="a checkpoint written by train.py (checkpoints/best.pt or "
                   "checkpoints/step_<N>.pt; a run directory: its checkpoints/best.pt), or several of one run: "
                   "their weights are averaged")
    p.add_argument("--input", default="-", help="source sentences, one per line (default, or -: standard input)")
    p.add_argument("--reference", help="reference translations, line for line: prints BLEU and chrF")
    p.add_argument("--output", help="where to write the translations (default: stdout)")
    p.add_argument("--tokenizer", help="the run's tokenizer directory (default: <run>/tokenizer)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--beam-size", type=int, default=1, help="1: greedy decoding (what training scores with by default)")
    p.add_argument("--length-penalty", type=float, default=0.6, help="with beams: GNMT's alpha (0: none)")
    args = p.parse_args(argv)
    if args.beam_size < 1:
        p.error(f"--beam-size {args.beam_size}: must be >= 1")
    if args.batch_size < 1:
        p.error(f"--batch-size {args.batch_size}: must be >= 1")
    if args.length_penalty < 0:
        p.error(f"--length-penalty {args.length_penalty}: must be >= 0 (0: no length penalty)")
    try:
        device = resolve_device(args.device)
        model, src_codec, tgt_codec, _ = load_translator(args.checkpoint, device, args.tokenizer)
        if args.input == "-" and sys.stdin.isatty():  # typed at a terminal: say what it waits for
            print("reading sentences from standard input, one per line; end with Ctrl-D", file=sys.stderr)
        sources = read_lines(args.input)
        references = read_lines(args.reference) if args.reference else None
        if references is not None and len(references) != len(sources):
            raise UserError(f"{args.input} has {len(sources)} lines but {args.reference} has {len(references)}")
        with torch.inference_mode():
            hyps = translate(model, sources, src_codec, tgt_codec, device, batch_size=args.batch_size,
                             beam_size=args.beam_size, alpha=args.length_penalty)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.output:
        with atomic_path(args.output) as tmp:
            tmp.write_text("\n".join(hyps) + "\n", encoding="utf-8")
    else:
        sys.stdout.write("\n".join(hyps) + "\n")
    if references is not None:
        print(json.dumps(score(hyps, references)), file=sys.stderr if not args.output else sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
