"""Compare a sweep's runs: `python experiments/report.py <multirun dir> [--out DIR]`.

Reads every job's summary.json and metrics.jsonl (no network), writes report.md (the table) and report.png
(peak memory against throughput with BLEU, and loss curves) into the sweep directory or --out, and prints the table.
Failed and out-of-memory jobs are listed with their reason.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from src.errors import UserError  # noqa: E402
from src.report import write_report  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", help="a multirun directory (outputs/multirun/<date>/<time>) or one run's directory")
    parser.add_argument("--out", help="where report.md and report.png go (default: the sweep directory)")
    args = parser.parse_args()
    try:
        md, png, table = write_report(args.sweep_dir, args.out)
    except UserError as e:
        sys.exit(f"error: {e}")
    print(table)
    print(f"wrote {md} and {png}")


if __name__ == "__main__":
    main()
