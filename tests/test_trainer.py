"""The training step: loss, schedule, and the memory strategies compute what they claim."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from src.data.batching import Batch, batch_indices, collate, pair_sizes, split_batch, truncate
from src.data.encode import EncodedSplit
from src.memory import MemoryStrategy
from src.model import ModelArgs, Transformer
from src.trainer import Trainer, inverse_sqrt_schedule, label_smoothed_loss, paper_peak_lr

PAD, BOS, EOS = 1, 0, 2


def make_split(n=8, seed=0, vocab=30) -> EncodedSplit:
    g = torch.Generator().manual_seed(seed)
    lens = [3, 17, 5, 11, 2, 9, 14, 6][:n]  # deliberately uneven
    src = [torch.randint(4, vocab, (n_,), generator=g) for n_ in lens]
    tgt = [torch.randint(4, vocab, (max(1, n_ - 1 + i % 3),), generator=g) for i, n_ in enumerate(lens)]
    return EncodedSplit(src, tgt)


def model_and_trainer(strategy: MemoryStrategy, dropout=0.0, seed=0, adam=False, lr=1.0):
    """With plain SGD (the default here) a parameter update is the gradient times lr, so equal updates mean
    equal gradients; Adam's first step, ``lr * g / |g|``, would amplify rounding noise in near-zero gradients."""
    torch.manual_seed(seed)
    model = Transformer(ModelArgs(src_vocab=30, tgt_vocab=30, pad_id=PAD, d_model=32, n_heads=4, d_ff=64,
                                  encoder_layers=2, decoder_layers=2, dropout=dropout))
    if adam:
        opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.98), eps=1e-9)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, inverse_sqrt_schedule(4))
    return model, Trainer(model, opt, sched, strategy, torch.device("cpu"), PAD, label_smoothing=0.1, clip_grad_norm=None)


def micro_batches(split: EncodedSplit, parts: int) -> list[Batch]:
    sizes = pair_sizes(split)
    return [
        collate([split.src[i] for i in p], [split.tgt[i] for i in p], PAD, BOS, EOS)
        for p in split_batch(list(range(len(split))), sizes, parts)
    ]


def updates(before: torch.nn.Module, after: torch.nn.Module) -> list[torch.Tensor]:
    return [pa.detach() - pb.detach() for pa, pb in zip(after.parameters(), before.parameters())]


def rel_update_diff(u: list[torch.Tensor], v: list[torch.Tensor]) -> float:
    """||u - v|| / ||v|| over all parameters together (per tensor, the key-projection biases, whose true
    gradient is zero because softmax ignores a constant added to every score, would compare rounding noise)."""
    flat_u, flat_v = torch.cat([a.flatten() for a in u]), torch.cat([b.flatten() for b in v])
    return ((flat_u - flat_v).norm() / flat_v.norm()).item()


def test_label_smoothed_loss_matches_pytorch():
    logits = torch.randn(3, 5, 11)
    target = torch.randint(0, 11, (3, 5))
    target[0, 3:] = PAD
    loss, nll = label_smoothed_loss(logits, target, PAD, 0.1)
    expected = F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=PAD, label_smoothing=0.1, reduction="sum")
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(nll, F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=PAD, reduction="sum"))


def test_schedule_is_the_papers():
    f = inverse_sqrt_schedule(4000)
    d = 512
    peak = paper_peak_lr(d, 4000)
    for step in (1, 100, 4000, 10000):
        paper = d**-0.5 * min(step**-0.5, step * 4000**-1.5)
        assert math.isclose(peak * f(step - 1), paper, rel_tol=1e-9)


@pytest.fixture
def one_batch_update():
    """(initial model, the parameter update of one optimizer step on the whole uneven batch)."""
    model, trainer = model_and_trainer(MemoryStrategy())
    start = copy.deepcopy(model)
    trainer.step(micro_batches(make_split(), 1))
    return start, updates(start, model)


def test_accumulated_micro_batches_equal_one_batch(one_batch_update):
    start, reference = one_batch_update
    acc_model, acc = model_and_trainer(MemoryStrategy(accum_steps=4))
    mbs = micro_batches(make_split(), 4)
    assert len({b.src.size(1) for b in mbs}) > 1 and len({b.n_tgt_tokens for b in mbs}) > 1  # uneven on purpose
    acc.step(mbs)
    assert rel_update_diff(updates(start, acc_model), reference) < 1e-5


def test_dividing_by_the_number_of_micro_batches_would_fail_the_same_check(one_batch_update):
    """The common mistake: average each micro-batch's loss over its own tokens, then divide by k."""
    start, reference = one_batch_update
    wrong, trainer = model_and_trainer(MemoryStrategy(accum_steps=4))
    mbs = micro_batches(make_split(), 4)
    for b in mbs:
        loss_sum, _ = label_smoothed_loss(wrong(b.src, b.tgt_in), b.tgt_out, PAD, 0.1)
        (loss_sum / b.n_tgt_tokens / len(mbs)).backward()
    trainer.optimizer.step()
    assert rel_update_diff(updates(start, wrong), reference) > 1e-3


def test_bf16_step_runs_on_cpu_and_stays_close_to_fp32():
    split = make_split()
    m32, t32 = model_and_trainer(MemoryStrategy())
    m16, t16 = model_and_trainer(MemoryStrategy(amp="bf16"))
    a = t32.step(micro_batches(split, 1))
    b = t16.step(micro_batches(split, 1))
    assert abs(b.loss_sum.item() - a.loss_sum.item()) / a.loss_sum.item() < 0.02
    assert not t16.scaler.is_enabled()


def test_fp16_uses_a_grad_scaler_and_counts_skipped_steps():
    split = make_split()
    _, trainer = model_and_trainer(MemoryStrategy(amp="fp16"))
    assert trainer.scaler.is_enabled()
    trainer.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)  # overflows fp16 on the first step
    stats = trainer.step(micro_batches(split, 1))
    assert stats.skipped and trainer.scaler.get_scale() < 2.0**40


def test_training_reduces_the_loss():
    split = make_split()
    _, trainer = model_and_trainer(MemoryStrategy(accum_steps=2), dropout=0.1, adam=True, lr=3e-3)
    losses = [trainer.step(micro_batches(split, 2)).loss_sum.item() for _ in range(40)]
    assert losses[-1] < 0.7 * losses[0]


def test_every_example_appears_once_per_epoch_in_a_reproducible_order():
    sizes = [(i * 7) % 23 + 1 for i in range(1000)]
    batches = batch_indices(sizes, 32, shuffle=True, seed=1, epoch=0, pool_batches=4)
    assert sorted(i for b in batches for i in b) == list(range(1000))
    assert batches == batch_indices(sizes, 32, shuffle=True, seed=1, epoch=0, pool_batches=4)
    assert batches != batch_indices(sizes, 32, shuffle=True, seed=1, epoch=1, pool_batches=4)
    parts = split_batch(batches[0], sizes, 3)
    assert sorted(i for p in parts for i in p) == sorted(batches[0]) and len(parts) == 3


def test_truncation_cuts_and_counts():
    split = EncodedSplit([torch.arange(10), torch.arange(3)], [torch.arange(4), torch.arange(8)])
    cut, stats = truncate(split, max_src_len=5, max_tgt_len=6)
    assert [len(s) for s in cut.src] == [5, 3] and [len(t) for t in cut.tgt] == [4, 6]
    d = stats.as_dict()
    assert d["sentences_truncated"] == 2 and d["src_tokens_cut"] == 5 and d["tgt_tokens_cut"] == 2
    assert d["tokens_cut_share"] == pytest.approx(7 / 25)
    _, none = truncate(split, None, None)
    assert none.sentences == 0
