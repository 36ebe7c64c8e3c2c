"""How well spaCy's tokens are joined back into text: learn the rules from Multi30k's training split, then
tokenize each validation and test reference and join it again. Scores are computed on joined text, so every line
that does not come back as it was costs BLEU that no model can win back.

    MULTI30K_ROOT=/path/to/multi30k python experiments/foundation/detok_roundtrip.py [--langs en de fr cs]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import sacrebleu

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from src.data.corpus import read_lines  # noqa: E402
from src.errors import UserError  # noqa: E402
from src.tokenizers import SpacyCodec  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", default=os.environ.get("MULTI30K_ROOT"), required="MULTI30K_ROOT" not in os.environ)
    p.add_argument("--langs", nargs="*", default=["en", "de", "fr", "cs"])
    p.add_argument("--show", type=int, default=2, help="lines that differ to print per split")
    args = p.parse_args()
    try:
        report(args)
    except UserError as e:
        sys.exit(f"error: {e} (--root {args.root}, --langs {' '.join(args.langs)})")


def report(args: argparse.Namespace) -> None:
    print("| language | split | lines changed | BLEU of the joined references |\n|---|---|---|---|")
    for lang in args.langs:
        codec = SpacyCodec.build(read_lines(Path(args.root) / f"train.{lang}.gz"), lang, min_freq=2)
        for split in ("val", "test_2016_flickr"):
            references = read_lines(Path(args.root) / f"{split}.{lang}.gz")
            joined = [codec.detokenize(tokens) for tokens in codec.tokenize(references)]
            # how many spaces separate two words does not score (nor spaces at the ends)
            changed = [(r, j) for r, j in zip(references, joined) if r.split() != j.split()]
            bleu = sacrebleu.corpus_bleu(joined, [references]).score
            print(f"| {lang} | {split} | {len(changed)} of {len(references)} | {bleu:.2f} |")
            for ref, got in changed[: args.show]:
                print(f"|   | | `{ref}` -> `{got}` | |")


if __name__ == "__main__":
    main()
