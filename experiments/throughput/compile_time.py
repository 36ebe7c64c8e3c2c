"""trainer.compile's cost on the CPU: a model of the reference workload's size (3+3 layers, d_model 256, its
vocabularies), compiled as a run compiles it (``Trainer.compile``: dynamic shapes), then 8 steps over 4 batch shapes
(the compiling) and 24 more (the compiled steps). Set TORCHINDUCTOR_CACHE_DIR to an empty folder to time a cold
compile: Inductor's on-disk cache otherwise serves graphs compiled before.

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python experiments/throughput/compile_time.py
"""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from src.data.batching import Batch  # noqa: E402
from src.memory import MemoryStrategy  # noqa: E402
from src.model import ModelArgs, Transformer  # noqa: E402
from src.trainer import Trainer, inverse_sqrt_schedule  # noqa: E402

SHAPES = [(64, 17, 19), (64, 23, 21), (64, 29, 31), (64, 13, 15)]  # (pairs, source, target positions)


def batch(pairs: int, src_len: int, tgt_len: int) -> Batch:
    g = torch.Generator().manual_seed(src_len * 100 + tgt_len)
    src, tgt_in, tgt_out = (torch.randint(4, 6000, (pairs, n), generator=g) for n in (src_len, tgt_len, tgt_len))
    return Batch(src, tgt_in, tgt_out, src.numel(), tgt_out.numel())


def main() -> None:
    torch.manual_seed(0)
    model = Transformer(ModelArgs(src_vocab=8012, tgt_vocab=6190, pad_id=1, d_model=256, n_heads=4, d_ff=1024,
                                  encoder_layers=3, decoder_layers=3, dropout=0.1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    trainer = Trainer(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, inverse_sqrt_schedule(4)),
                      MemoryStrategy(), torch.device("cpu"), 1, 0.1, 1.0)
    trainer.compile()
    started = time.perf_counter()
    for shape in SHAPES * 2:
        trainer.step([batch(*shape)])
    compiled = time.perf_counter()
    for shape in SHAPES * 6:
        trainer.step([batch(*shape)])
    done = time.perf_counter()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads: the first 8 steps (4 shapes) "
          f"{compiled - started:.1f} s; then {(done - compiled) / 24 * 1000:.0f} ms a step (24 steps)")


if __name__ == "__main__":
    main()
