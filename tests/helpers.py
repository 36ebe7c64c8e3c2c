"""Small models, batches and comparisons shared by the training-step tests; running the command-line tools;
reading back their files."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from src.data import batching
from src.data.batching import Batch, pair_sizes
from src.data.encode import EncodedSplit
from src.memory import MemoryStrategy
from src.model import ModelArgs, Transformer
from src.trainer import Trainer, inverse_sqrt_schedule

PAD, BOS, EOS = 1, 0, 2
ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str, cwd: Path = ROOT, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    """A command-line tool of the project, as a user runs it (W&B offline, Hugging Face hub off)."""
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", **(env_extra or {})}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def make_split(n=8, seed=0, vocab=30) -> EncodedSplit:
    g = torch.Generator().manual_seed(seed)
    lens = [3, 17, 5, 11, 2, 9, 14, 6][:n]  # deliberately uneven
    src = [torch.randint(4, vocab, (n_,), generator=g) for n_ in lens]
    tgt = [torch.randint(4, vocab, (max(1, n_ - 1 + i % 3),), generator=g) for i, n_ in enumerate(lens)]
    return EncodedSplit(src, tgt)


def model_and_trainer(strategy: MemoryStrategy, dropout=0.0, seed=0, adam=False, lr=1.0, world=None, layers=2):
    """With plain SGD (the default here) a parameter update is the gradient times lr, so equal updates mean
    equal gradients; Adam's first step, ``lr * g / |g|``, would amplify rounding noise in near-zero gradients."""
    torch.manual_seed(seed)
    model = Transformer(ModelArgs(src_vocab=30, tgt_vocab=30, pad_id=PAD, d_model=32, n_heads=4, d_ff=64,
                                  encoder_layers=layers, decoder_layers=layers, dropout=dropout))
    if adam:
        opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.98), eps=1e-9)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, inverse_sqrt_schedule(4))
    return model, Trainer(model, opt, sched, strategy, torch.device("cpu"), PAD, label_smoothing=0.1, clip_grad_norm=None,
                          world=world)


def micro_batches(split: EncodedSplit, parts: int) -> list[Batch]:
    """The whole split as one batch of ``parts`` micro-batches."""
    return batching.micro_batches(split, list(range(len(split))), pair_sizes(split), parts, PAD, BOS, EOS)


def updates(before: torch.nn.Module, after: torch.nn.Module) -> list[torch.Tensor]:
    return [pa.detach() - pb.detach() for pa, pb in zip(after.parameters(), before.parameters())]


def rel_update_diff(u: list[torch.Tensor], v: list[torch.Tensor]) -> float:
    """||u - v|| / ||v|| over all parameters together (per tensor, the key-projection biases, whose true
    gradient is zero because softmax ignores a constant added to every score, would compare rounding noise)."""
    flat_u, flat_v = torch.cat([a.flatten() for a in u]), torch.cat([b.flatten() for b in v])
    return ((flat_u - flat_v).norm() / flat_v.norm()).item()


def count_host_copies(monkeypatch, of=lambda tensor: True) -> list:
    """A list that grows by one at each ``.item()`` or ``.tolist()`` of a tensor that is ``of`` the kind counted (on
    a GPU, each waits for the device to catch up); ``clear()`` it to count from there."""
    copies: list = []

    def counted(real):
        return lambda t, *a, **k: (copies.append(1) if of(t) else None) or real(t, *a, **k)

    for name in ("item", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, counted(getattr(torch.Tensor, name)))
    return copies


def read_wandb_run(path, wait_s: float = 30.0) -> dict:
    """An offline W&B run file (``run-*.wandb``) read back with wandb's own reader: the run record, the config,
    the history rows, the final summary (summary updates applied in order) and the exit record. Read again until
    the exit record is there (or ``wait_s`` has passed): ``wandb.finish()`` in a process that goes on can return
    before W&B's service has written the whole file (seen twice in about 75 runs of a test that read it at once).
    A file read while the service is still writing it can also end in half a record, which wandb's reader takes
    for a bad checksum (CI at 90d72b2); that too is read again, and raised only if it is still there at the end."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            out = _read_wandb_file(path)
        except AssertionError:  # wandb's DataStore asserts on a short or mismatched record
            if time.monotonic() >= deadline:
                raise
        else:
            if out["exit_code"] is not None or time.monotonic() >= deadline:
                return out
        time.sleep(0.2)


def _read_wandb_file(path) -> dict:
    from wandb.proto import wandb_internal_pb2 as pb
    from wandb.sdk.internal.datastore import DataStore

    store = DataStore()
    store.open_for_scan(str(path))
    out = {"run": None, "config": {}, "history": [], "summary": {}, "exit_code": None, "metrics": {}}
    while (data := store.scan_data()) is not None:
        record = pb.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out["run"] = record.run
            for item in record.run.config.update:
                out["config"][item.key] = json.loads(item.value_json)
        elif kind == "config":
            for item in record.config.update:
                out["config"][item.key] = json.loads(item.value_json)
        elif kind == "history":
            out["history"].append({_key(i): json.loads(i.value_json) for i in record.history.item})
        elif kind == "summary":
            for item in record.summary.update:
                out["summary"][_key(item)] = json.loads(item.value_json)
        elif kind == "metric":
            out["metrics"][record.metric.name] = record.metric
        elif kind == "exit":
            out["exit_code"] = record.exit.exit_code
    return out


def _key(item) -> str:
    return item.key or ".".join(item.nested_key)
