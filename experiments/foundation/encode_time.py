"""Time the tokenizing and encoding of a corpus as a run does it (spaCy in a forked child per side, at once), print
the children's peak RSS, and save what the cache would hold; with --compare, check that another such file (made at
another commit) holds the same codecs and the same ids.

    python experiments/foundation/encode_time.py --root ../shared/data/multi30k --out /tmp/new.pt
    python experiments/foundation/encode_time.py --prefix /data/big --out /tmp/new.pt --compare /tmp/old.pt

--prefix reads {prefix}/train, val and test_2016_flickr .de/.en (data=files); --root reads Multi30k's raw files.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from src.data import encode  # noqa: E402
from src.data.prepare import load_corpus  # noqa: E402
from src.fileio import atomic_path  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", help="the Multi30k raw files' folder")
    parser.add_argument("--prefix", help="a folder of train/val/test_2016_flickr .de/.en files")
    parser.add_argument("--out", required=True, help="where to save the encoded corpus")
    parser.add_argument("--compare", help="an encoded corpus saved by this script to compare with")
    args = parser.parse_args()
    data = ({"name": "files", **{f"{split}_prefix": f"{args.prefix}/{stem}" for split, stem in
                                 (("train", "train"), ("valid", "val"), ("test", "test_2016_flickr"))}}
            if args.prefix else {"name": "multi30k", "root": args.root})
    corpus = load_corpus({**data, "src_lang": "de", "tgt_lang": "en"}, Path("/nonexistent"), download_ok=False)
    start = time.monotonic()
    blob, peaks = encode._encode(corpus, {"name": "spacy", "min_freq": 2, "lowercase": False}, fork=True)
    print(f"tokenized and encoded {sum(map(len, corpus.splits.values())):,} pairs in {time.monotonic() - start:.1f} s;"
          f" children's peak RSS {' and '.join(f'{p:.0f}' for p in peaks)} MB")
    with atomic_path(Path(args.out)) as tmp:  # (a killed run leaves no half-written file)
        torch.save(blob, tmp)
    if args.compare:
        other = torch.load(args.compare, weights_only=True)
        same_ids = blob["splits"].keys() == other["splits"].keys() and all(
            torch.equal(blob["splits"][s][side][k], other["splits"][s][side][k])
            for s in blob["splits"] for side in ("src", "tgt") for k in ("ids", "lengths"))
        print(f"the same codecs: {blob['codecs'] == other['codecs']}; the same ids: {same_ids}")
