"""The training step: loss, schedule, and the memory strategies compute what they claim."""

import contextlib
import copy
import math
from array import array

import pytest
import torch
import torch.nn.functional as F

from src import trainer as trainer_module
from src.data.batching import (
    batch_indices,
    check_token_budget,
    collate,
    epoch_batches,
    limit_lengths,
    pair_sizes,
    split_batch,
    target_sizes,
    token_batch_indices,
)
from src.data.encode import EncodedSplit, PackedSequences
from src.distributed import World
from src.memory import MemoryStrategy
from src.trainer import inverse_sqrt_schedule, label_smoothed_loss, paper_peak_lr

from .helpers import (
    BOS,
    EOS,
    PAD,
    count_host_copies,
    make_split,
    micro_batches,
    model_and_trainer,
    rel_update_diff,
    updates,
)

# The loss works through the logits LOSS_PIECE at a time: 22 = 2 positions of 11 per piece (8 pieces, the last partial).
CHUNKS = pytest.mark.parametrize("chunk", [trainer_module.LOSS_PIECE, 22], ids=["one-piece", "8-pieces"])


@CHUNKS
def test_label_smoothed_loss_matches_pytorch(chunk, monkeypatch):
    monkeypatch.setattr(trainer_module, "LOSS_PIECE", chunk)
    logits = torch.randn(3, 5, 11)
    target = torch.randint(0, 11, (3, 5))
    target[0, 3:] = PAD
    loss, nll = label_smoothed_loss(logits, target, PAD, 0.1)
    expected = F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=PAD, label_smoothing=0.1, reduction="sum")
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(nll, F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=PAD, reduction="sum"))


@CHUNKS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_label_smoothed_loss_gradient_is_autograds_through_pytorch(dtype, chunk, monkeypatch):
    """The closed-form backward gives what autograd gives through F.cross_entropy, for any weighting of the two
    outputs, with padding, and in the logits' own dtype (bf16 under autocast)."""
    monkeypatch.setattr(trainer_module, "LOSS_PIECE", chunk)
    logits = torch.randn(3, 5, 11, dtype=torch.float64).to(dtype)
    target = torch.randint(0, 11, (3, 5))
    target[0, 3:] = PAD
    target[2, 1] = 4  # a target repeated within the batch
    target[2, 2] = 4
    ours = logits.clone().requires_grad_()
    loss, nll = label_smoothed_loss(ours, target, PAD, 0.1)
    (0.7 * loss + 0.2 * nll).backward()
    ref = logits.double().requires_grad_()
    flat, t = ref.flatten(0, 1), target.flatten()
    smoothed = F.cross_entropy(flat, t, ignore_index=PAD, label_smoothing=0.1, reduction="sum")
    (0.7 * smoothed + 0.2 * F.cross_entropy(flat, t, ignore_index=PAD, reduction="sum")).backward()
    assert ours.grad.dtype == dtype
    assert ours.grad[0, 3:].abs().max() == 0  # padding gets no gradient
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(ours.grad.double(), ref.grad, atol=tol, rtol=tol)


def test_schedule_is_the_papers():
    f = inverse_sqrt_schedule(4000)
    d = 512
    peak = paper_peak_lr(d, 4000)
    for step in (1, 100, 4000, 10000):
        paper = d**-0.5 * min(step**-0.5, step * 4000**-1.5)
        assert math.isclose(peak * f(step - 1), paper, rel_tol=1e-9)


def eager_update(layers: int = 2) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    """(initial model, the parameter update of one optimizer step on the whole uneven batch)."""
    model, trainer = model_and_trainer(MemoryStrategy(), layers=layers)
    start = copy.deepcopy(model)
    trainer.step(micro_batches(make_split(), 1))
    return start, updates(start, model)


@pytest.fixture
def one_batch_update():
    return eager_update()


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


def test_a_step_is_the_label_smoothed_loss_per_target_token(one_batch_update):
    """The loss a step descends is its label-smoothed sum over the batch's target tokens divided by their number
    (as computed here by hand), not by its source tokens, its pairs or its padded positions; its figures say so."""
    start, reference = one_batch_update
    model, trainer = model_and_trainer(MemoryStrategy())
    batch = micro_batches(make_split(), 1)[0]
    assert batch.n_tgt_tokens != batch.n_src_tokens
    loss_sum, _ = label_smoothed_loss(model(batch.src, batch.tgt_in), batch.tgt_out, PAD, 0.1)
    (loss_sum / batch.n_tgt_tokens).backward()
    trainer.optimizer.step()
    assert rel_update_diff(updates(start, model), reference) < 1e-5
    stats = model_and_trainer(MemoryStrategy())[1].step([batch])
    assert (stats.n_tgt_tokens, stats.n_src_tokens) == (batch.n_tgt_tokens, batch.n_src_tokens)
    assert stats.loss_sum.item() == pytest.approx(loss_sum.item(), rel=1e-5)


def test_no_warmup_is_the_peak_rate_at_once_then_the_inverse_square_root():
    """optim.warmup_steps=0, which the settings allow: the first step at the peak rate, then 1/sqrt(step)."""
    factor = inverse_sqrt_schedule(0)
    assert [factor(i) for i in range(3)] == [1.0, 2**-0.5, 3**-0.5]


def test_bf16_step_runs_on_cpu_and_stays_close_to_fp32():
    """memory=amp computes in bf16 (the matrix products' outputs are bf16 during the step: a step left in fp32
    would pass a closeness check alone) and stays within 2% of the fp32 loss."""
    split = make_split()
    m32, t32 = model_and_trainer(MemoryStrategy())
    m16, t16 = model_and_trainer(MemoryStrategy(amp="bf16"))
    dtypes = {}

    def record(name):
        def hook(module, args, out):
            dtypes[name] = out.dtype
        return hook

    for name, model in (("fp32", m32), ("bf16", m16)):  # a matrix product's output (layer norms stay in fp32)
        next(m for m in model.encoder[0].modules() if isinstance(m, torch.nn.Linear)).register_forward_hook(record(name))
    a = t32.step(micro_batches(split, 1))
    b = t16.step(micro_batches(split, 1))
    assert dtypes == {"fp32": torch.float32, "bf16": torch.bfloat16}
    assert 0 < abs(b.loss_sum.item() - a.loss_sum.item()) / a.loss_sum.item() < 0.02
    assert not t16.scaler.is_enabled()


def products_from_bf16_parts() -> bool:
    """Whether this CPU computes fp32 products from bf16 parts at PyTorch's "medium" precision (oneDNN where the
    CPU multiplies bf16); elsewhere they stay fp32. Asked of PyTorch itself, not of the code under test."""
    a = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    torch.set_float32_matmul_precision("medium")
    try:
        medium = a @ a
    finally:
        torch.set_float32_matmul_precision("highest")
    return not torch.equal(medium, a @ a)


@pytest.mark.skipif(not products_from_bf16_parts(), reason="this CPU multiplies fp32 in fp32 at every precision")
def test_matmul_precision_medium_rounds_the_steps_products_to_bf16_inside_its_block_only():
    """trainer.matmul_precision=medium: tensors stay fp32 (unlike amp) but their products are computed from bf16
    parts, so the loss moves off the exact one by bf16's rounding and no more; after the block, PyTorch's default
    gives the exact step again (a sweep's next job)."""
    from src.kernels import matmul_precision

    split = make_split()
    losses = []
    for block in (contextlib.nullcontext(), matmul_precision("medium"), contextlib.nullcontext()):
        _, trainer = model_and_trainer(MemoryStrategy())
        with block:
            losses.append(trainer.step(micro_batches(split, 1)).loss_sum.item())
    assert losses[0] == losses[2]
    assert 0 < abs(losses[1] - losses[0]) / losses[0] < 0.01


class TwoRanks(World):
    """Rank 0 of two, as Trainer.step sees it after DDP has synchronized the gradients: ``any`` also hears the
    other rank's flag. Set on a one-process trainer (no process group, no DDP wrapper)."""

    def __init__(self, other_rank_says: bool = False):
        super().__init__(rank=0, size=2)
        self.other_rank_says = other_rank_says

    def any(self, flag: bool) -> bool:
        return flag or self.other_rank_says


@pytest.mark.parametrize("world", [World(), TwoRanks()], ids=["one-process", "data-parallel"])
def test_fp16_uses_a_grad_scaler_and_counts_skipped_steps(world):
    """An overflow is the scaler's routine skip, not a non-finite step (which trainer.on_nonfinite would count
    and, past trainer.max_nonfinite, stop the run for): also data-parallel, where it used to be one."""
    split = make_split()
    _, trainer = model_and_trainer(MemoryStrategy(amp="fp16"))
    trainer.world = world
    assert trainer.scaler.is_enabled()
    trainer.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)  # overflows fp16 on the first step
    stats = trainer.step(micro_batches(split, 1))
    assert stats.skipped and not stats.nonfinite and trainer.scaler.get_scale() < 2.0**40
    assert trainer.scheduler.last_epoch == 0  # the schedule counts the updates taken


def test_a_non_finite_step_takes_no_update_and_does_not_advance_the_schedule():
    """A NaN loss in fp32 (trainer.on_nonfinite=skip goes on after it): no parameter moves, Adam makes no state,
    and the schedule counts only the updates taken, so the next step trains at the rate of the first."""
    split = make_split()
    model, trainer = model_and_trainer(MemoryStrategy(), adam=True, lr=1e-3)
    before = copy.deepcopy(model.state_dict())
    trainer.inject_nonfinite = True
    stats = trainer.step(micro_batches(split, 1))
    assert stats.nonfinite and not stats.skipped
    assert trainer.scheduler.last_epoch == 0 and not trainer.optimizer.state
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    lr = trainer.lr
    stats = trainer.step(micro_batches(split, 1))
    assert not stats.nonfinite and stats.lr == lr and trainer.scheduler.last_epoch == 1
    assert not all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# the test's own stand-in for optimizer.step, which the scheduler notices
@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden:UserWarning")
def test_fp16_out_of_memory_in_the_optimizer_step_can_be_redone():
    """Out of memory after the GradScaler unscaled the gradients (clipping, Adam's first step making its state):
    the redone step takes the update a step without the error takes. It raised the scaler's RuntimeError
    "unscale_() has already been called", so the run failed instead of backing off."""
    split = make_split()
    reference, plain = model_and_trainer(MemoryStrategy(amp="fp16"), adam=True, lr=1e-3)
    plain.step(micro_batches(split, 1))
    model, trainer = model_and_trainer(MemoryStrategy(amp="fp16"), adam=True, lr=1e-3)
    step, calls = trainer.optimizer.step, []

    def out_of_memory_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("out of memory (Adam's state)")
        return step(*args, **kwargs)

    trainer.optimizer.step = out_of_memory_once
    with pytest.raises(torch.OutOfMemoryError):
        trainer.step(micro_batches(split, 1))
    trainer.optimizer.zero_grad(set_to_none=True)  # as the run's back-off does
    stats = trainer.step(micro_batches(split, 1))
    assert not stats.skipped and trainer.scaler.get_scale() == plain.scaler.get_scale()
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), model.parameters(), strict=True))


def test_fp16_data_parallel_ranks_agree_on_a_nan_loss_on_one_of_them():
    """Another rank's NaN loss makes this rank's step non-finite too: every rank skips it, or stops, alike."""
    split = make_split()
    model, trainer = model_and_trainer(MemoryStrategy(amp="fp16"))
    trainer.world = TwoRanks(other_rank_says=True)
    before = [p.detach().clone() for p in model.parameters()]
    stats = trainer.step(micro_batches(split, 1))
    assert stats.nonfinite and not stats.skipped
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


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
    # seeds and epochs are not interchangeable: seed replicates do not share their data orders
    assert batch_indices(sizes, 32, True, seed=0, epoch=1) != batch_indices(sizes, 32, True, seed=1, epoch=0)
    assert token_batch_indices(sizes, 256, True, seed=0, epoch=1) != token_batch_indices(sizes, 256, True, seed=1, epoch=0)


def test_sentence_batches_are_bucketed_by_length():
    """Each batch is cut from one pool of pool_batches x batch_size pairs sorted by length, so it pads little: here
    1.3% of the padded positions with the default pools of 100 batches, 46% unsorted (pools of one batch)."""
    g = torch.Generator().manual_seed(1)
    sizes = torch.randint(2, 60, (2000,), generator=g).tolist()

    def padding(batches):
        return 1 - sum(sizes) / sum(len(b) * max(sizes[i] for i in b) for b in batches)

    assert padding(batch_indices(sizes, 32, shuffle=True, seed=0)) < 0.05 < 0.3 < padding(
        batch_indices(sizes, 32, shuffle=True, seed=0, pool_batches=1))


@pytest.mark.parametrize("n,parts", [(4, 4), (5, 4), (7, 3), (64, 5), (3, 8)])
def test_micro_batches_differ_by_at_most_one_pair_and_none_is_empty(n, parts):
    sizes = [(i * 7) % 23 + 1 for i in range(n)]
    split = split_batch(list(range(n)), sizes, parts)
    assert len(split) == min(n, parts) and all(split)
    assert max(map(len, split)) - min(map(len, split)) <= 1
    assert [i for p in split for i in p] == sorted(range(n), key=lambda i: sizes[i])  # neighbouring lengths


def reference_batches(sizes, batch_size, shuffle, seed, epoch, pool_batches=100):
    """batch_indices as lists of Python ints, one pair at a time (as it was until 2026-12-06): the rule it keeps."""
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(len(sizes), generator=g).tolist() if shuffle else list(range(len(sizes)))
    pool, batches = batch_size * pool_batches, []
    for start in range(0, len(sizes), pool):
        chunk = sorted(order[start:start + pool], key=lambda i: sizes[i])
        batches += [chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size)]
    return [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()] if shuffle else batches


def reference_token_batches(sizes, max_tokens, shuffle, seed, epoch):
    """token_batch_indices, one pair at a time (until 2026-12-06)."""
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(len(sizes), generator=g).tolist() if shuffle else list(range(len(sizes)))
    order.sort(key=lambda i: sizes[i])
    batches, current = [], []
    for i in order:
        if current and (len(current) + 1) * sizes[i] > max_tokens:
            batches.append(current)
            current = []
        current.append(i)
    batches += [current] if current else []
    return [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()] if shuffle else batches


def test_an_epochs_batches_in_one_tensor_are_the_batches_made_a_pair_at_a_time():
    """EpochBatches (the indices in one tensor, worked out a pool or a size at a time) against the rules as loops
    over Python lists: the same batches in the same order, for sentence batches and token budgets, with and
    without shuffling, empty and tiny epochs, pools of one batch; and the same slices, and batches without the
    pairs already trained (a run resumed with other batches: TrainingRun.steps)."""
    import random

    rng = random.Random(0)
    for case in range(150):
        n = rng.choice([0, 1, 2, 5, 17, 64, 333, 1000])
        sizes = [rng.randint(1, rng.choice([3, 10, 60, 200])) for _ in range(n)]
        shuffle, seed, epoch = rng.random() < 0.8, rng.randint(0, 5), rng.randint(0, 3)
        batch_size, pool_batches = rng.randint(1, 70), rng.choice([1, 4, 100])
        max_tokens = max(sizes, default=1) * rng.choice([1, 2, 5, 40]) + rng.randint(0, 9)
        batches = batch_indices(sizes, batch_size, shuffle, seed, epoch, pool_batches)
        reference = reference_batches(sizes, batch_size, shuffle, seed, epoch, pool_batches)
        assert batches.tolist() == reference, case
        assert token_batch_indices(sizes, max_tokens, shuffle, seed, epoch) == reference_token_batches(
            sizes, max_tokens, shuffle, seed, epoch), case
        first, stop = sorted(rng.randint(0, len(reference)) for _ in range(2))
        assert batches[first:stop] == reference[first:stop] and batches[first:][-1:] == reference[first:][-1:]
        trained = torch.rand(n, generator=torch.Generator().manual_seed(case)) < rng.random()
        assert batches.without(trained) == [kept for b in reference if (kept := [i for i in b if not trained[i]])]
        if case % 5 == 0:  # the sizes as pair_sizes gives them, 4-byte ints in an array
            assert batch_indices(array("i", sizes), batch_size, shuffle, seed, epoch, pool_batches) == reference, case
            assert token_batch_indices(array("i", sizes), max_tokens, shuffle, seed, epoch) == reference_token_batches(
                sizes, max_tokens, shuffle, seed, epoch), case


def test_a_pairs_size_is_its_longer_side_and_its_target_size_the_target_each_with_its_special_token():
    lengths = [(3, 7), (9, 2), (0, 0), (5, 5)]
    src, tgt = ([torch.zeros(n[side], dtype=torch.int32) for n in lengths] for side in (0, 1))
    packed = EncodedSplit(*(PackedSequences(torch.cat(seqs), torch.tensor([len(x) for x in seqs])) for seqs in (src, tgt)))
    for split in (EncodedSplit(src, tgt), packed):
        sizes, targets = pair_sizes(split), target_sizes(split)
        assert (list(sizes), list(targets)) == ([8, 10, 1, 6], [8, 3, 1, 6])
        assert sizes.itemsize == targets.itemsize == 4  # 4 bytes a pair: 17 MiB each for WMT14's 4.5M pairs
    assert len(pair_sizes(EncodedSplit([], []))) == len(target_sizes(EncodedSplit([], []))) == 0


def test_a_token_budget_holds_a_pair_of_exactly_its_size_and_fills_batches_to_it():
    check_token_budget(10, 10)
    with pytest.raises(ValueError, match=r"data.max_tokens=10 is smaller than the longest training pair \(11 tokens"):
        check_token_budget(10, 11)
    assert token_batch_indices([10] * 8, 40, shuffle=False) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # 4 x 10 = 40: full


def test_truncation_cuts_and_counts():
    split = EncodedSplit([torch.arange(10), torch.arange(3)], [torch.arange(4), torch.arange(8)])
    cut, stats = limit_lengths(split, max_src_len=5, max_tgt_len=6)
    assert [len(s) for s in cut.src] == [5, 3] and [len(t) for t in cut.tgt] == [4, 6]
    d = stats.as_dict()
    assert d["pairs_affected"] == 2 and d["src_tokens_removed"] == 5 and d["tgt_tokens_removed"] == 2
    assert d["tokens_removed_share"] == pytest.approx(7 / 25) and d["overlong"] == "truncate"
    _, none = limit_lengths(split, None, None)
    assert none.pairs == 0
    # a cut target keeps its </s> (as Hugging Face tokenizers truncate; padding there measured worse: README)
    batch = collate(cut.src, cut.tgt, PAD, BOS, EOS)
    assert batch.tgt_out[1].tolist() == [0, 1, 2, 3, 4, 5, EOS] and batch.src[0].tolist() == [0, 1, 2, 3, 4, EOS]


def test_overlong_pairs_can_be_dropped_instead():
    split = EncodedSplit([torch.arange(10), torch.arange(3), torch.arange(2)], [torch.arange(4), torch.arange(8), torch.arange(2)])
    kept, stats = limit_lengths(split, max_src_len=5, max_tgt_len=6, overlong="drop")
    assert [len(s) for s in kept.src] == [2] and [len(t) for t in kept.tgt] == [2]
    d = stats.as_dict()
    assert d["pairs_affected"] == 2 and d["pairs_affected_share"] == pytest.approx(2 / 3)
    assert d["src_tokens_removed"] == 13 and d["tgt_tokens_removed"] == 12


@pytest.mark.parametrize("group", [100_000, 7])
@pytest.mark.parametrize("overlong", ["truncate", "drop"])
@pytest.mark.parametrize("caps", [(5, 7), (None, 3), (4, None), (None, None), (0, 40)])
def test_a_packed_split_is_limited_as_each_sentence_would_be(overlong, caps, group, monkeypatch):
    """limit_lengths keeps the split packed (a tensor per sentence cost 1.1 GB more at a million pairs): the same
    sentences, ids and counts as cutting (or dropping) sentence by sentence, from a packed split or a list, whether
    the sentences are cut all at once or a group at a time (batching.CUT_GROUP)."""
    from src.data import batching
    from src.data.encode import PackedSequences

    monkeypatch.setattr(batching, "CUT_GROUP", group)
    g = torch.Generator().manual_seed(3)
    sides = [[torch.randint(4, 99, (int(n),), generator=g) for n in torch.randint(0, 12, (60,), generator=g)]
             for _ in range(2)]
    packed = EncodedSplit(*(PackedSequences(torch.cat(side), torch.tensor([len(x) for x in side])) for side in sides))
    cut = [[(len(x) - cap if cap is not None and len(x) > cap else 0) for x in side] for side, cap in zip(sides, caps)]
    over = [bool(a or b) for a, b in zip(*cut)]
    kept = [i for i, o in enumerate(over) if not (o and overlong == "drop")]
    for split in (packed, EncodedSplit(*sides)):
        limited, stats = limit_lengths(split, *caps, overlong=overlong)
        assert isinstance(limited.src, PackedSequences) and len(limited) == len(kept)
        for side, out, cuts in zip(sides, (limited.src, limited.tgt), cut):
            assert [t.tolist() for t in out] == [side[i][:len(side[i]) - cuts[i]].tolist() for i in kept]
        assert stats.pairs == sum(over) and stats.total_pairs == 60
        removed = [sum(len(x) if o else 0 for x, o in zip(side, over)) if overlong == "drop" else sum(cuts)
                   for side, cuts in zip(sides, cut)]
        assert [stats.src_tokens_removed, stats.tgt_tokens_removed] == removed


@pytest.mark.parametrize("max_tokens", [40, 64, 257, 1000])
def test_token_batches_respect_the_budget_and_cover_the_epoch(max_tokens):
    g = torch.Generator().manual_seed(0)
    src = [torch.randint(4, 30, (int(n),), generator=g) for n in torch.randint(1, 39, (500,), generator=g)]
    tgt = [torch.randint(4, 30, (int(n),), generator=g) for n in torch.randint(1, 39, (500,), generator=g)]
    split = EncodedSplit(src, tgt)
    sizes = pair_sizes(split)
    for epoch in (0, 1):
        batches = token_batch_indices(sizes, max_tokens, shuffle=True, seed=3, epoch=epoch)
        assert sorted(i for b in batches for i in b) == list(range(500))  # each example exactly once
        for b in batches:
            assert len(b) * max(sizes[i] for i in b) <= max_tokens  # padding counted
            batch = collate([src[i] for i in b], [tgt[i] for i in b], PAD, BOS, EOS)
            assert batch.src.numel() <= max_tokens and batch.tgt_out.numel() <= max_tokens
    assert token_batch_indices(sizes, max_tokens, True, 3, 0) == token_batch_indices(sizes, max_tokens, True, 3, 0)
    assert token_batch_indices(sizes, max_tokens, True, 3, 0) != token_batch_indices(sizes, max_tokens, True, 3, 1)


def test_token_batches_pad_less_than_random_sentence_batches():
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(2, 60, (2000,), generator=g).tolist()
    split = EncodedSplit([torch.ones(n, dtype=torch.long) * 5 for n in lens], [torch.ones(n, dtype=torch.long) * 5 for n in lens])
    sizes = pair_sizes(split)

    def padding(batches):
        padded = sum(len(b) * max(sizes[i] for i in b) for b in batches)
        return 1 - sum(sizes) / padded

    random_batches = [list(range(i, min(i + 64, 2000))) for i in range(0, 2000, 64)]
    assert padding(token_batch_indices(sizes, 64 * 32, True)) < 0.05 < 0.3 < padding(random_batches)


def test_a_budget_below_the_longest_pair_is_a_clear_error():
    with pytest.raises(ValueError, match=r"data.max_tokens=10 is smaller than the longest training pair \(12 tokens"):
        token_batch_indices([5, 12, 3], 10, shuffle=False)



@pytest.mark.slow
def test_compiled_step_gives_the_eager_update():
    """trainer.compile: four micro-batches of different lengths through the compiled forward pass and loss
    (dynamic shapes) give the same update as one eager step on the whole batch, from one graph: no graph break
    (the loss's class attribute once broke it, and the loss ran eagerly) and no compiling again per length.
    A 1+1-layer model: Inductor's compile is most of this test (15 s on 2 cores, 22 s for 2+2 layers)."""
    start, reference = eager_update(layers=1)
    model, trainer = model_and_trainer(MemoryStrategy(accum_steps=4), layers=1)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    trainer.compile()
    mbs = micro_batches(make_split(), 4)
    assert len({b.src.size(1) for b in mbs}) > 1
    trainer.step(mbs)
    counters = torch._dynamo.utils.counters
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters["graph_break"])
    assert rel_update_diff(updates(start, model), reference) < 1e-4
    # the vector width is in Inductor's cache key: graphs cached under another width are not reused here
    from torch._inductor import config, cpu_vec_isa

    assert config.cpp.simdlen == cpu_vec_isa.pick_vec_isa().bit_width() > 0
    torch._dynamo.reset()


@pytest.mark.slow
def test_a_compiled_step_with_dropout_is_one_graph(monkeypatch):
    """On the CPU the model's dropout draws its coins with ``random_``, which Dynamo does not trace: compiled, the
    step broke into a graph at every dropout (11 graphs for a 1+1-layer model). Compiling, it is nn.Dropout's.
    Dynamo's own backend, as below."""
    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: compile_module(self, backend="eager", **kw))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model, trainer = model_and_trainer(MemoryStrategy(accum_steps=2), dropout=0.1)
    trainer.compile()
    trainer.step(micro_batches(make_split(), 2))
    counters = torch._dynamo.utils.counters
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters["graph_break"])
    torch._dynamo.reset()


@pytest.mark.slow
def test_a_compiled_step_with_the_chunked_loss_gives_the_eager_update(one_batch_update, monkeypatch):
    """trainer.compile with memory=chunked_ce: the layers compiled, the checkpointed chunks run eagerly (traced,
    they stopped the run at step 1 with an AssertionError from Dynamo). Dynamo's own backend, as below."""
    start, reference = one_batch_update
    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: compile_module(self, backend="eager", **kw))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model, trainer = model_and_trainer(MemoryStrategy(accum_steps=2, loss_chunk=7))
    trainer.compile()
    trainer.step(micro_batches(make_split(), 2))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # the layers were compiled
    assert rel_update_diff(updates(start, model), reference) < 1e-4
    torch._dynamo.reset()


@pytest.mark.slow
def test_a_sweeps_next_job_compiles_its_own_graph(one_batch_update, monkeypatch):
    """Two jobs in one process, as in a sweep: the second compiles its own graph and does not run the first job's,
    which Dynamo's guards would accept for a model of the same structure. Both jobs use Dynamo's own backend
    (Inductor's code generation, which the test above runs, took 24 s of a second job on 2 cores)."""
    start, reference = one_batch_update
    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: compile_module(self, backend="eager", **kw))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    mbs = micro_batches(make_split(), 4)
    for job in (1, 2):
        model, trainer = model_and_trainer(MemoryStrategy(accum_steps=4))
        trainer.compile()
        trainer.step(mbs)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == job
        assert rel_update_diff(updates(start, model), reference) < 1e-4
    torch._dynamo.reset()


def test_validation_loss_is_per_target_token_with_end_of_sentence_and_ppl_its_nlls_exponent():
    """valid_loss, valid_nll and valid_ppl: sums over every target token, </s> included, divided by their number,
    whatever the batching (it was only ever compared between runs that would share a wrong divisor)."""
    from types import SimpleNamespace

    from src.evaluate import validation_loss

    model, _ = model_and_trainer(MemoryStrategy())
    split = make_split()
    codec = SimpleNamespace(pad_id=PAD, bos_id=BOS, eos_id=EOS)
    got = validation_loss(model, split, codec, torch.device("cpu"), batch_size=3, label_smoothing=0.1)
    loss = nll = tokens = 0.0
    with torch.no_grad():
        for src, tgt in zip(split.src, split.tgt, strict=True):
            out = torch.cat([tgt, torch.tensor([EOS])])
            logits = model(torch.cat([src, torch.tensor([EOS])])[None], torch.cat([torch.tensor([BOS]), tgt])[None])[0]
            loss += F.cross_entropy(logits, out, label_smoothing=0.1, reduction="sum").item()
            nll += F.cross_entropy(logits, out, reduction="sum").item()
            tokens += len(out)
    assert got["loss"] == pytest.approx(loss / tokens, rel=1e-5) and got["nll"] == pytest.approx(nll / tokens, rel=1e-5)
    assert got["ppl"] == pytest.approx(math.exp(nll / tokens), rel=1e-5)


def test_validation_loss_copies_its_sums_to_the_host_once_whatever_the_batches(monkeypatch):
    """The losses are summed where they are computed (in float64, as Python's floats summed them), and copied to
    the host once: a copy per batch, as there were two, waits for a GPU each time. (The
    batches' indices are copied too, from the host's own tensors: the float ones are counted.)"""
    from types import SimpleNamespace

    from src.evaluate import validation_loss

    model, _ = model_and_trainer(MemoryStrategy())
    codec = SimpleNamespace(pad_id=PAD, bos_id=BOS, eos_id=EOS)
    copies = count_host_copies(monkeypatch, of=torch.Tensor.is_floating_point)
    for batch_size in (1, 7):  # 8 batches, then 2
        copies.clear()
        validation_loss(model, make_split(), codec, torch.device("cpu"), batch_size=batch_size, label_smoothing=0.1)
        assert len(copies) == 1, (batch_size, len(copies))


def test_the_padding_ratio_is_the_share_of_the_positions_computed_on_that_were_padding():
    """padding_ratio (metrics.jsonl, summary.json): of the source and target positions of a step's micro-batches,
    each padded to its own longest sentence, the share that were padding; the window's and the run's alike."""
    from src.window import Window

    _, trainer = model_and_trainer(MemoryStrategy(accum_steps=2))
    batches = micro_batches(make_split(), 2)
    positions = sum(b.src.numel() + b.tgt_out.numel() for b in batches)
    padding = sum(int((b.src == PAD).sum() + (b.tgt_out == PAD).sum()) for b in batches)
    assert 0 < padding < positions / 2
    window = Window(torch.device("cpu"))
    window.add(trainer.step(batches))
    assert window.flush()["padding_ratio"] == pytest.approx(padding / positions)
    assert window.padding_ratio(total=True) == pytest.approx(padding / positions)


@pytest.mark.parametrize("clip", [0.5, None])
def test_the_update_takes_the_gradients_clipped_to_the_configured_norm(clip):
    """optim.clip_grad_norm: the gradients Adam steps with have that norm (when theirs is above it), and the norm
    logged is the one before clipping; null: the gradients as they are."""
    model, trainer = model_and_trainer(MemoryStrategy())
    trainer.clip_grad_norm = clip
    stepped_with = []
    trainer.optimizer.register_step_pre_hook(lambda *_: stepped_with.append(
        float(torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()])))))
    stats = trainer.step(micro_batches(make_split(), 1))
    assert float(stats.grad_norm) > 0.5  # the batch's norm (before clipping)
    assert stepped_with == [pytest.approx(clip or float(stats.grad_norm), rel=1e-5)]


def test_fp16_clips_the_unscaled_gradients():
    """memory.amp=fp16: the GradScaler's scaled gradients are unscaled before clipping, so the norm clipped and
    logged is the true one and the update is fp32's, up to fp16 rounding (clipped while scaled, nearly every
    update shrank by the scale, 2^10 here)."""
    split = make_split()
    results = []
    for strategy in (MemoryStrategy(), MemoryStrategy(amp="fp16")):
        model, trainer = model_and_trainer(strategy)
        trainer.clip_grad_norm = 0.5
        if strategy.amp:
            trainer.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        before = copy.deepcopy(model)
        stats = trainer.step(micro_batches(split, 1))
        assert not stats.skipped
        results.append((float(stats.grad_norm), updates(before, model)))
    (norm32, update32), (norm16, update16) = results
    assert norm32 > 0.5 and norm16 == pytest.approx(norm32, rel=0.02)  # clipping applies: the norm is above 0.5
    assert rel_update_diff(update16, update32) < 0.05


@pytest.mark.parametrize("max_tokens", [None, 400])
def test_an_epochs_batches_run_in_a_shuffled_order_of_sizes(max_tokens):
    """Batches are made of neighbouring sizes (little padding), then their order is shuffled: an epoch does not
    run short batches first and long ones last (orders differing by seed and epoch passed with that bug, ties
    being drawn at random). The rank correlation of a batch's size with its place is about 0."""
    g = torch.Generator().manual_seed(0)
    sizes = torch.randint(3, 60, (2000,), generator=g).tolist()
    batches = epoch_batches(sizes, 16, max_tokens, shuffle=True, seed=1, epoch=0)
    largest = torch.tensor([float(max(sizes[i] for i in b)) for b in batches])
    ranks = largest.argsort().argsort().float()
    place = torch.arange(len(batches), dtype=torch.float)
    rho = torch.corrcoef(torch.stack([ranks, place]))[0, 1].item()
    assert abs(rho) < 0.2, rho
