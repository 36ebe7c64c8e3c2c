"""Greedy decoding against beam search on one trained checkpoint: test BLEU, chrF and decoding time.

    python experiments/throughput/beam.py CHECKPOINT --input test.de.gz --reference test.en.gz \
        [--settings 1:0 4:0.6 4:0 8:0.6]

Each setting is beams:length_penalty; 1 is greedy decoding. Times are the translate() call alone (batches of 128
sentences, the model already loaded), best of --repeat runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from src.checkpoint import load_translator  # noqa: E402
from src.data.corpus import read_lines  # noqa: E402
from src.evaluate import score, translate  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("checkpoint", nargs="+", help="a checkpoint, or several of one run to average")
    p.add_argument("--input", required=True)
    p.add_argument("--reference", required=True)
    p.add_argument("--settings", nargs="*", default=["1:0", "4:0.6", "4:0", "8:0.6"])
    p.add_argument("--repeat", type=int, default=2)
    args = p.parse_args()
    model, src_codec, tgt_codec, _ = load_translator(args.checkpoint, torch.device("cpu"), None)
    sources, references = read_lines(args.input), read_lines(args.reference)
    names = " ".join(args.checkpoint)
    print(f"{names}: {len(sources)} sentences, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| beams | length penalty | BLEU | chrF | decoding (s) |\n|---|---|---|---|---|")
    for setting in args.settings:
        beams, alpha = setting.split(":")
        times = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            with torch.inference_mode():
                hyps = translate(model, sources, src_codec, tgt_codec, torch.device("cpu"), beam_size=int(beams),
                                 alpha=float(alpha))
            times.append(time.perf_counter() - start)
        s = score(hyps, references)
        print(f"| {beams} | {alpha if int(beams) > 1 else '-'} | {s['bleu']:.2f} | {s['chrf']:.2f} | {min(times):.2f} |",
              flush=True)


if __name__ == "__main__":
    main()
