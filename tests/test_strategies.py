"""Each memory strategy computes what the plain computation does, and saves what it claims to save."""

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from src.data.batching import Batch
from src.data.corpus import load_synthetic
from src.data.encode import encode_corpus, trim_vocabulary
from src.data.synthetic import LengthDistribution
from src.memory import MemoryStrategy, TensorMemoryTracker, memory_strategy
from src.model import ModelArgs, Transformer
from src.run import train
from src.tokenizers import TrimmedCodec
from src.trainer import batch_loss

from .conftest import FAST, compose_config
from .helpers import PAD, make_split, micro_batches, model_and_trainer


def flat_grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def grads(strategy: MemoryStrategy, dropout: float, seed: int = 123, model_seed: int = 0):
    model, _ = model_and_trainer(strategy, dropout=dropout, seed=model_seed)  # the Trainer applies the strategy
    calls = {"n": 0}

    def counted(forward):
        def run(*args, **kwargs):
            calls["n"] += 1
            return forward(*args, **kwargs)

        return run

    for layer in [*model.encoder, *model.decoder]:
        layer.forward = counted(layer.forward)  # (forward hooks do not fire in checkpoint recomputation)
    batch = micro_batches(make_split(), 1)[0]
    torch.manual_seed(seed)
    loss, nll = batch_loss(model.train(), batch, PAD, 0.1, strategy.loss_chunk)
    loss.backward()
    return torch.stack([loss, nll]).detach(), flat_grads(model), calls["n"]  # (the NLL: the logged perplexity's)


def test_checkpointed_layers_give_the_same_gradients_with_dropout_on():
    loss, plain, plain_calls = grads(MemoryStrategy(), dropout=0.1)
    loss_ckpt, ckpt, ckpt_calls = grads(MemoryStrategy(checkpoint=True), dropout=0.1)
    assert ckpt_calls == 2 * plain_calls  # every layer really ran again during backward
    assert rel(ckpt, plain) < 1e-6 and torch.equal(loss_ckpt, loss)
    _, other_masks, _ = grads(MemoryStrategy(), dropout=0.1, seed=124)
    assert rel(other_masks, plain) > 1e-3  # dropout is on: the equality above is not vacuous


@pytest.mark.parametrize("chunk", [1, 7, 16, 37, 64, 73, 10_000])
def test_chunked_loss_equals_the_full_loss_and_gradients(chunk):
    n_targets = sum(len(t) + 1 for t in make_split().tgt)
    assert n_targets % 7 and n_targets % 16 and n_targets % 64  # chunk sizes that do not divide the tokens
    assert n_targets % 37 == 0 and n_targets % 73 == 1  # one that does, one that leaves a single token over
    loss, full, _ = grads(MemoryStrategy(), dropout=0.0)
    loss_chunked, chunked, _ = grads(MemoryStrategy(loss_chunk=chunk), dropout=0.0)
    assert (abs((loss_chunked - loss) / loss) < 1e-6).all()  # the smoothed loss and the NLL
    assert rel(chunked, full) < 1e-6


def peak_bytes(strategy: MemoryStrategy, vocab: int, layers: int, length: int = 48, batch: int = 16) -> int:
    torch.manual_seed(0)
    model = Transformer(ModelArgs(src_vocab=vocab, tgt_vocab=vocab, pad_id=PAD, d_model=64, n_heads=4, d_ff=256,
                                  encoder_layers=layers, decoder_layers=layers, dropout=0.1))
    model.checkpoint_layers = strategy.checkpoint
    src = torch.randint(4, vocab, (batch, length))
    tgt = torch.randint(4, vocab, (batch, length))
    b = Batch(src, tgt, tgt, src.numel(), tgt.numel())
    tracker = TensorMemoryTracker()
    tracker.track(list(model.parameters()))
    with tracker:
        loss, _ = batch_loss(model.train(), b, PAD, 0.1, strategy.loss_chunk)
        loss.backward()
    return tracker.peak


def test_chunked_loss_saves_the_logits_memory():
    full = peak_bytes(MemoryStrategy(), vocab=20_000, layers=1)
    chunked = peak_bytes(MemoryStrategy(loss_chunk=64), vocab=20_000, layers=1)
    logits = 16 * 48 * 20_000 * 4
    # without chunks two tensors of the logits' size coexist at the peak (the logits, kept for backward, and
    # their gradient); with them, none
    assert full - chunked > 1.5 * logits


def test_checkpointing_saves_activation_memory():
    plain = peak_bytes(MemoryStrategy(), vocab=100, layers=6)
    ckpt = peak_bytes(MemoryStrategy(checkpoint=True), vocab=100, layers=6)
    assert ckpt < 0.6 * plain


def test_checkpointed_layers_under_autocast_keep_no_half_precision_copy_of_their_weights():
    """memory=[amp,checkpoint]: a checkpointed layer saves nothing for backward, its weights' bf16 casts included.
    Autocast's cache kept each cast until forward ended, so every layer's weights were held again at 2 bytes a
    parameter: under memory=fsdp a copy of the gathered layers on every rank, its peak with 4 ranks
    (src/model.py's ``uncached_autocast``). Tracked here: what forward allocates, one pair of 4 tokens."""
    torch.manual_seed(0)
    model = Transformer(ModelArgs(src_vocab=100, tgt_vocab=100, pad_id=PAD, d_model=128, n_heads=4, d_ff=1024,
                                  encoder_layers=4, decoder_layers=4))
    model.checkpoint_layers = True
    layers = sum(p.numel() for layer in [*model.encoder, *model.decoder] for p in layer.parameters())
    src = torch.randint(4, 100, (1, 4))
    tracker = TensorMemoryTracker()
    with tracker, torch.autocast("cpu", torch.bfloat16):
        loss, _ = batch_loss(model.train(), Batch(src, src, src, 4, 4), PAD, 0.1)
    assert loss.requires_grad
    # one weight's cast at a time (0.3 MB), not every layer's (5.8 MB with the cache)
    assert tracker.peak < 0.25 * 2 * layers, tracker.peak_by_category


def test_bf16_training_still_reduces_the_loss():
    """Under bf16 autocast (the output projection's products in bf16 at every step, seen by a hook), 40 steps
    still reduce the loss."""
    model, trainer = model_and_trainer(MemoryStrategy(amp="bf16"), dropout=0.1, adam=True, lr=3e-3)
    dtypes = set()
    model.generator.register_forward_hook(lambda module, args, out: dtypes.add(out.dtype))
    losses = [trainer.step(micro_batches(make_split(), 1)).loss_sum.item() for _ in range(40)]
    assert dtypes == {torch.bfloat16}
    assert losses[-1] < 0.7 * losses[0]


def test_trimmed_vocabulary_round_trips_training_sentences(xlmr_dir, tmp_path):
    corpus = load_synthetic("de", "en", {"train": 300, "valid": 30, "test": 30}, 5, LengthDistribution())
    full = encode_corpus(corpus, {"name": "xlmr", "name_or_path": str(xlmr_dir)}, tmp_path)
    trimmed = trim_vocabulary(full)
    codec = trimmed.src_codec
    assert codec is trimmed.tgt_codec and isinstance(codec, TrimmedCodec)  # a shared vocabulary stays shared
    assert len(codec) < len(full.src_codec)
    assert (codec.bos_id, codec.pad_id, codec.eos_id, codec.unk_id) == (0, 1, 2, 3)
    for side, texts in (("src", corpus.train.src), ("tgt", corpus.train.tgt)):
        for text, before, after in zip(texts, getattr(full.splits["train"], side), getattr(trimmed.splits["train"], side)):
            assert codec.decode(after.tolist()) == full.src_codec.decode(before.tolist())
            assert codec.encode([text])[0] == after.tolist()
    assert codec.unk_id not in torch.cat(list(trimmed.splits["train"].src)).tolist()
    assert {getattr(split, side).ids.dtype for split in trimmed.splits.values() for side in ("src", "tgt")} == {
        torch.int32}  # renumbered, still 4 bytes an id


@pytest.mark.parametrize("overlong", ["truncate", "drop"])
def test_a_vocabulary_trimmed_after_truncation_holds_the_pieces_trained_on(xlmr_dir, tmp_path, overlong):
    """memory=[truncate,trim_vocab]: the vocabulary keeps the pieces of the pairs as they are trained on, not those
    only cut tails or dropped pairs held (they were kept: embedding, output and Adam rows never trained)."""
    from src.data.prepare import prepare_data

    cfg = compose_config(*FAST, "tokenizer=xlmr", f"tokenizer.name_or_path={xlmr_dir}", "memory=[truncate,trim_vocab]",
                         "memory.max_src_len=6", "memory.max_tgt_len=6", f"memory.overlong={overlong}",
                         run_dir=tmp_path / "run", cache_dir=tmp_path / "cache")
    conf = OmegaConf.to_container(cfg, resolve=True)
    _, encoded, train, info = prepare_data(conf, memory_strategy(conf["memory"]))
    used = torch.cat([*train.src, *train.tgt]).unique().tolist()
    specials = {encoded.src_codec.bos_id, encoded.src_codec.pad_id, encoded.src_codec.eos_id, encoded.src_codec.unk_id}
    assert len(encoded.src_codec) == len(set(used) | specials) == info["trim_vocab"]["vocab_after"]["src"]
    dropped = info["length_limit"]["pairs_affected"] if overlong == "drop" else 0
    assert max(len(s) for s in train.src) <= 6
    assert len(train) == info["sentences"]["train"] == info["length_limit"]["pairs_before"] - dropped


def test_a_truncated_run_holds_its_training_pairs_as_cut_and_lets_the_uncut_ones_go(tmp_path, monkeypatch):
    """memory=truncate: the encoded corpus's training split is the cut one, and nothing holds the uncut ids (they
    were held beside the cut ones for the whole run: 143 MiB of a 1M-pair corpus, experiments/foundation)."""
    import gc
    import weakref

    from src.data import prepare

    uncut, real = [], prepare.limit_lengths

    def limit_lengths(split, *args):
        uncut.append(weakref.ref(split.src))
        return real(split, *args)

    monkeypatch.setattr(prepare, "limit_lengths", limit_lengths)
    cfg = compose_config(*FAST, "memory=truncate", "memory.max_src_len=6", "memory.max_tgt_len=6",
                         run_dir=tmp_path / "run", cache_dir=tmp_path / "cache")
    conf = OmegaConf.to_container(cfg, resolve=True)
    _, encoded, train, info = prepare.prepare_data(conf, memory_strategy(conf["memory"]))
    assert info["length_limit"]["pairs_affected"] > 0 and max(len(s) for s in train.src) <= 6
    assert encoded.splits["train"] is train and len(encoded.splits["valid"]) == info["sentences"]["valid"]
    gc.collect()
    assert len(uncut) == 1 and uncut[0]() is None


def test_a_trimmed_xlmr_run_translates_again_from_its_directory(fast_cfg, xlmr_dir, tmp_path):
    """The trimmed ids are the run's own: translate.py reads the run's tokenizer/ (XLM-R's files and the id map it
    saved) and gives the run's test translations back."""
    from .test_train_e2e import translate_test_set

    cfg = fast_cfg("tokenizer=xlmr", f"tokenizer.name_or_path={xlmr_dir}", "memory=trim_vocab")
    summary = train(cfg)
    assert summary["status"] == "completed" and summary["vocab"]["src"] < summary["trim_vocab"]["vocab_before"]["src"]
    hyps = (Path(cfg.paths.output_dir) / "test.hyp.txt").read_text().splitlines()
    assert translate_test_set(cfg, tmp_path) == hyps


def test_trimming_separate_vocabularies(tmp_path):
    corpus = load_synthetic("de", "en", {"train": 200, "valid": 20, "test": 20}, 5, LengthDistribution())
    full = encode_corpus(corpus, {"name": "spacy", "min_freq": 1}, tmp_path)
    trimmed = trim_vocabulary(full)
    assert trimmed.src_codec is not trimmed.tgt_codec
    assert len(trimmed.src_codec) == len(full.src_codec)  # spaCy vocabularies come from train: nothing to cut
    for before, after in zip(full.splits["test"].tgt, trimmed.splits["test"].tgt):
        assert trimmed.tgt_codec.decode(after.tolist()) == full.tgt_codec.decode(before.tolist())


ALL = "memory=[amp,accum,truncate,tokens,checkpoint,chunked_ce,trim_vocab]"


@pytest.mark.slow
def test_every_strategy_at_once_runs_end_to_end(fast_cfg, xlmr_dir):
    summary = train(fast_cfg(ALL, "tokenizer=xlmr", f"tokenizer.name_or_path={xlmr_dir}", "data.max_tokens=400",
                             "memory.loss_chunk=32", "memory.max_src_len=24", "memory.max_tgt_len=24"))
    assert summary["status"] == "completed"
    assert summary["strategy"] == "amp+accum+truncate+tokens+checkpoint+chunked_ce+trim_vocab"
    assert summary["max_tokens"] == 400 and summary["accum_steps"] == 4 and summary["amp"] == "bf16"
    trim = summary["trim_vocab"]
    assert trim["vocab_after"]["src"] < trim["vocab_before"]["src"]
    assert trim["parameters_after"] < trim["parameters_before"] and summary["parameters"] == trim["parameters_after"]
    assert summary["length_limit"]["pairs_affected"] > 0 and 0 <= summary["padding_ratio"] < 1
