"""Resident memory that a run's data holds once it is prepared: the encoded corpus and the training split as
training reads them (after memory=truncate's cuts and memory=trim_vocab), with the corpus text let go, as a run
lets go of it (the training text once encoded, the rest once its evaluation sets are made). Takes train.py's
overrides; reads (or writes) the same cache.

    python experiments/foundation/data_memory.py data=files data.src_lang=de ... memory=truncate
"""

import gc
import sys
import tempfile
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from src.data.prepare import prepare_data  # noqa: E402
from src.memory import memory_strategy, peak_rss_mb  # noqa: E402


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as out, initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[*sys.argv[1:], f"paths.output_dir={out}"])
        conf = OmegaConf.to_container(cfg, resolve=True)
        gc.collect()
        before = rss_mib()
        corpus, encoded, train_split, info = prepare_data(conf, memory_strategy(conf["memory"]))
        del corpus
        gc.collect()
        print(f"{info['sentences']} pairs; held by the prepared data: {rss_mib() - before:.0f} MiB "
              f"(the process's peak so far {peak_rss_mb():.0f} MiB)")
