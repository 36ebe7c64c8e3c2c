"""Greedy decoding against beam search on one trained checkpoint: test BLEU, chrF and decoding time.

    python experiments/throughput/beam.py CHECKPOINT --input test.de.gz --reference test.en.gz \
        [--settings 1:0 4:0.6 4:0 8:0.6]

Each setting is beams:length_penalty; 1 is greedy decoding. Times are the translate() call alone (batches of 128
sentences, the model already loaded), best of --repeat runs.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from src.checkpoint import load_translator  # noqa: E402
from src.data.corpus import read_lines  # noqa: E402
from src.errors import UserError  # noqa: E402
from src.evaluate import score, translate  # noqa: E402
from translate import run_decoding  # noqa: E402


def setting(text: str) -> tuple[int, float]:
    """``beams:length_penalty``, as argparse reads one."""
    try:
        beams, alpha = text.split(":")
        beams, alpha = int(beams), float(alpha)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text}: expected beams:length_penalty, e.g. 4:0.6") from None
    if beams < 1 or alpha < 0:
        raise argparse.ArgumentTypeError(f"{text}: beams must be >= 1 and the length penalty >= 0")
    return beams, alpha


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("checkpoint", nargs="+", help="a checkpoint, or several of one run to average")
    p.add_argument("--input", required=True)
    p.add_argument("--reference", required=True)
    p.add_argument("--settings", nargs="*", type=setting, default=[(1, 0.0), (4, 0.6), (4, 0.0), (8, 0.6)])
    p.add_argument("--repeat", type=int, default=2)
    args = p.parse_args()
    if args.repeat < 1:
        p.error(f"--repeat {args.repeat}: must be >= 1")
    try:
        model, src_codec, tgt_codec, ckpt = load_translator(args.checkpoint, torch.device("cpu"), None)
        sources, references = read_lines(args.input), read_lines(args.reference)
        if len(sources) != len(references):
            raise UserError(f"{args.input} has {len(sources)} lines but {args.reference} has {len(references)}")
    except UserError as e:
        sys.exit(f"error: {e}")
    config = ckpt.get("config") or {}
    decoding = run_decoding(ckpt)  # the run's length caps, as translate.py decodes
    caps = {key: decoding[key] for key in ("max_len_a", "max_len_b")}
    tgt_lang = (config.get("data") or {}).get("tgt_lang")
    names = " ".join(args.checkpoint)
    print(f"{names}: {len(sources)} sentences, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"max length {caps['max_len_a']} x source + {caps['max_len_b']}")
    print("| beams | length penalty | BLEU | chrF | decoding (s) |\n|---|---|---|---|---|")
    for beams, alpha in args.settings:
        times = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            with torch.inference_mode():
                hyps = translate(model, sources, src_codec, tgt_codec, torch.device("cpu"), args.input,
                                 beam_size=beams, alpha=alpha, **caps)
            times.append(time.perf_counter() - start)
            # every later call translates the same sources: their warnings (words not in the vocabulary) said once
            logging.getLogger("src.evaluate").setLevel(logging.ERROR)
        s = score(hyps, references, tgt_codec.lowercase, tgt_lang)  # as the run scored: cased or not
        print(f"| {beams} | {alpha if beams > 1 else '-'} | {s['bleu']:.2f} | {s['chrf']:.2f} | {min(times):.2f} |",
              flush=True)


if __name__ == "__main__":
    main()
