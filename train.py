"""Train and evaluate a Transformer translation model: `python train.py [group=option ...] [key=value ...]`.

A sweep: `python train.py -m memory=none,amp,accum`. See README.md and conf/train.yaml.
"""

import logging
import sys

import hydra
from omegaconf import DictConfig

from src.errors import UserError
from src.run import train

log = logging.getLogger("train")


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    try:
        summary = train(cfg)
    except UserError as e:
        log.error("error: %s", e)  # one line naming the key, file or line; summary.json records it too
        sys.exit(1)
    print(f"[{summary['strategy']}] test BLEU {summary['test_bleu']:.2f} (valid {summary['valid_bleu']:.2f}), "
          f"{summary['tokens_per_s']:.0f} tokens/s, peak memory {summary['peak_memory_mb']} MB -> {cfg.paths.output_dir}")
    return summary["valid_bleu"]  # the value a Hydra sweeper (e.g. Optuna) maximizes


if __name__ == "__main__":
    main()
