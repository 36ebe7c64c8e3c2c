"""Beam search: with one beam it is greedy decoding, with enough beams it finds what exhaustive search finds, and a
sentence's translation does not depend on the batch it is decoded in."""

import itertools

import pytest
import torch
from torch.nn.utils.rnn import pad_sequence

from src.errors import NumericalError
from src.evaluate import beam_search, greedy_decode, length_penalty, unknown_words
from src.model import ModelArgs, Transformer

from .helpers import count_host_copies

BOS, PAD, EOS = 0, 1, 2


def reverser(vocab: int, max_words: int, steps: int = 150) -> Transformer:
    """A small model trained for a second to write its source (1 to ``max_words`` words) backwards: its
    translations end, at different steps for sentences of different lengths, and each token depends on the ones
    before it, as a real model's do."""
    torch.manual_seed(0)
    m = Transformer(ModelArgs(src_vocab=vocab, tgt_vocab=vocab, pad_id=PAD, d_model=32, n_heads=4, d_ff=64,
                              encoder_layers=2, decoder_layers=2, dropout=0.0))
    opt = torch.optim.Adam(m.parameters(), lr=3e-3)
    for _ in range(steps):
        words = [torch.randint(3, vocab, (int(n),)) for n in torch.randint(1, max_words + 1, (32,))]
        src = pad_sequence([torch.cat([w, torch.tensor([EOS])]) for w in words], batch_first=True, padding_value=PAD)
        tgt = pad_sequence([torch.cat([torch.tensor([BOS]), w.flip(0), torch.tensor([EOS])]) for w in words],
                           batch_first=True, padding_value=PAD)
        loss = torch.nn.functional.cross_entropy(m(src, tgt[:, :-1]).flatten(0, 1), tgt[:, 1:].flatten(),
                                                 ignore_index=PAD)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return m.eval()


@pytest.fixture(scope="module")
def model() -> Transformer:
    return reverser(30, 8)


SRC = torch.tensor([[5, 6, 7, 8, 9, EOS], [10, 11, EOS, PAD, PAD, PAD], [12, 13, 14, EOS, PAD, PAD]])


def until_eos(row: torch.Tensor) -> list[int]:
    ids = row.tolist()
    return ids[: ids.index(EOS) + 1] if EOS in ids else ids  # no </s>: the whole row, max_len tokens


def test_one_beam_is_greedy_decoding(model):
    greedy = greedy_decode(model, SRC, BOS, EOS, PAD, max_len=12)
    beam, _ = beam_search(model, SRC, BOS, EOS, PAD, max_len=12, beam_size=1)
    assert [until_eos(r) for r in beam] == [until_eos(r) for r in greedy]
    assert len({len(until_eos(r)) for r in greedy}) > 1  # the batch shrank while decoding


def test_a_sentence_translates_the_same_alone_and_in_a_batch(model):
    batch, scores = beam_search(model, SRC, BOS, EOS, PAD, max_len=12, beam_size=4, alpha=0.6)
    assert len({len(until_eos(r)) for r in batch}) > 1
    for i, src in enumerate(SRC):
        alone, score = beam_search(model, src[src != PAD].unsqueeze(0), BOS, EOS, PAD, max_len=12, beam_size=4,
                                   alpha=0.6)
        assert until_eos(alone[0]) == until_eos(batch[i])
        torch.testing.assert_close(score[0], scores[i], rtol=1e-5, atol=1e-5)


def test_beam_search_copies_to_the_host_per_step_not_per_hypothesis(model, monkeypatch):
    """Each ``.item()`` or ``.tolist()`` waits for a GPU to catch up: setting finished hypotheses aside copies the
    same few times a step however many there are (it copied twice for each: 5,532 copies for 512 sentences, 156
    now). Sixteen copies of the batch take the same steps, so the same number of copies, and translate each copy
    the same."""
    copies = count_host_copies(monkeypatch)

    def count(src: torch.Tensor) -> tuple[int, torch.Tensor]:
        copies.clear()
        out, _ = beam_search(model, src, BOS, EOS, PAD, max_len=12, beam_size=4, alpha=0.6)
        return len(copies), out

    few, once = count(SRC)
    many, sixteen = count(SRC.repeat(16, 1))
    assert torch.equal(sixteen, once.repeat(16, 1))
    assert few == many, (few, many)


@torch.no_grad()
def log_probs(m: Transformer, src: torch.Tensor, targets: list[list[int]]) -> list[float]:
    """Each target's log-probability given ``src``, from the full forward pass (targets of one length)."""
    tgt = torch.tensor(targets)
    tgt_in = torch.cat([torch.full((len(targets), 1), BOS), tgt[:, :-1]], dim=1)
    logp = torch.log_softmax(m(src.expand(len(targets), -1), tgt_in).float(), dim=-1)
    return logp.gather(2, tgt.unsqueeze(2)).squeeze(2).sum(1).tolist()


def exhaustive_best(m: Transformer, src: torch.Tensor, max_len: int, vocab: int, alpha: float):
    """The best target of each source row, and its normalized score, over every target of up to ``max_len``
    tokens, each scored by the full forward pass."""
    words = [t for t in range(vocab) if t != EOS]  # BOS and PAD too: nothing stops a model from writing them
    by_length = [[[*p, EOS] for p in itertools.product(words, repeat=n - 1)] for n in range(1, max_len + 1)]
    by_length[-1] += [list(p) for p in itertools.product(words, repeat=max_len)]  # cut at max_len, no </s>
    best = []
    for row in src:
        s = row[row != PAD]
        scored = {tuple(t): lp / length_penalty(len(t), alpha)
                  for targets in by_length for t, lp in zip(targets, log_probs(m, s, targets))}
        top = max(scored, key=scored.get)
        best.append((top, scored[top]))
    return best


@pytest.mark.parametrize("alpha", [0.0, 0.6, 2.0])
def test_enough_beams_find_the_best_translation_by_exhaustive_search(alpha):
    """Every target of up to 4 tokens over a 6-token vocabulary, scored by the full forward pass of a half-trained
    reverser, for each of the 39 sources of 1 to 3 words: with 125 beams (every open hypothesis kept) beam search
    must return the best of them by normalized score, with that score. Greedy decoding misses it for some
    sources (which ones depends on the CPU's floating-point kernels, through the training): there the first word
    that looked best was not, the best hypothesis changes beams on the way, and a cache that did not follow its
    hypothesis is caught."""
    vocab, max_len = 6, 4
    m = reverser(vocab, 3, steps=40)
    sources = [torch.tensor([*w, EOS]) for n in (1, 2, 3) for w in itertools.product((3, 4, 5), repeat=n)]
    src = pad_sequence(sources, batch_first=True, padding_value=PAD)
    best = exhaustive_best(m, src, max_len, vocab, alpha)
    found, scores = beam_search(m, src, BOS, EOS, PAD, max_len=max_len, beam_size=5 ** (max_len - 1), alpha=alpha)
    for row, (target, score) in enumerate(best):
        assert tuple(until_eos(found[row])) == target
        assert abs(float(scores[row]) - score) < 1e-4  # scored while searching as the full pass scores it
    greedy = greedy_decode(m, src, BOS, EOS, PAD, max_len=max_len)
    assert any(tuple(until_eos(g)) != target for g, (target, _) in zip(greedy, best))


def test_at_max_len_the_open_hypotheses_count_as_they_are(model):
    """The first sentence's translation (five words and </s>) cannot end within 2 tokens: its best open
    hypothesis is returned, scored with its 2 tokens."""
    out, scores = beam_search(model, SRC[:1], BOS, EOS, PAD, max_len=2, beam_size=4, alpha=0.6)
    ids = out[0].tolist()
    assert len(ids) == 2 and EOS not in ids
    assert abs(float(scores[0]) - log_probs(model, SRC[0], [ids])[0] / length_penalty(2, 0.6)) < 1e-4


@pytest.mark.parametrize("beam_size", [1, 3])
def test_a_translation_does_not_depend_on_the_sentences_batched_with_it(model, beam_size):
    """Each sentence may run to max_len_a x its own source length + max_len_b tokens, not the batch's longest
    source's: translated alone or in batches of any size, a sentence comes out the same, also where it is cut."""
    from types import SimpleNamespace

    from src.evaluate import translate_ids

    torch.manual_seed(1)
    sources = [torch.randint(3, 30, (n,)) for n in (1, 7, 3, 8, 5, 2)]
    codec = SimpleNamespace(bos_id=BOS, eos_id=EOS, pad_id=PAD, other_specials=())

    def translations(batch_size: int) -> list[list[int]]:
        rows = translate_ids(model, sources, codec, codec, torch.device("cpu"), batch_size, 0.5, 1,
                             beam_size=beam_size)
        return [[t for t in row if t != PAD] for row in rows]

    alone = translations(1)
    assert translations(2) == translations(6) == alone
    # the reverser writes a source of n words in about n + 1 tokens: caps of 0.5 x (n + 1) + 1 cut most of them,
    # and a cut under a cap below the batch's longest source's shows that the cap is each sentence's own
    caps = [int(0.5 * (len(s) + 1) + 1) for s in sources]
    assert all(len(ids) <= cap for ids, cap in zip(alone, caps))
    cut = [len(ids) == cap and EOS not in ids for ids, cap in zip(alone, caps)]
    assert sum(cut) >= 3 and any(c and cap < max(caps) for c, cap in zip(cut, caps)), (cut, caps)


def test_one_beam_is_greedy_decoding_under_bf16_autocast():
    """In bf16 the two best logits tie every few hundred tokens (8 bits of mantissa); greedy decoding's argmax and
    one beam's topk broke ties differently (4-5 of 60 sentences of a random model differed), until the logits of
    a decoding step were computed in fp32."""
    torch.manual_seed(0)
    m = Transformer(ModelArgs(src_vocab=40, tgt_vocab=40, pad_id=PAD, d_model=32, n_heads=4, d_ff=64,
                              encoder_layers=2, decoder_layers=2, dropout=0.0))
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.25)  # confident, varied logits: long translations, many close calls
    m.eval()
    src = pad_sequence([torch.cat([torch.randint(3, 40, (int(n),)), torch.tensor([EOS])])
                        for n in torch.randint(1, 30, (60,))], batch_first=True, padding_value=PAD)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        greedy = greedy_decode(m, src, BOS, EOS, PAD, max_len=40)
        beam, _ = beam_search(m, src, BOS, EOS, PAD, max_len=40, beam_size=1)
    assert [until_eos(r) for r in beam] == [until_eos(r) for r in greedy]


def test_an_odd_d_model_has_its_positions():
    m = Transformer(ModelArgs(src_vocab=20, tgt_vocab=20, pad_id=PAD, d_model=15, n_heads=3, d_ff=16,
                              encoder_layers=1, decoder_layers=1, dropout=0.0))
    assert m(SRC, SRC[:, :4]).shape == (3, 4, 20)


def test_no_translation_holds_padding_the_start_token_or_another_special_token(monkeypatch):
    """A model whose best next token is padding, <s> or another special token (XLM-R's <mask>: an untrained
    model's can be any) still writes only real tokens: the detokenizer drops them, so the text scored would not be
    the one searched."""
    MASK = 11
    torch.manual_seed(0)
    m = Transformer(ModelArgs(src_vocab=12, tgt_vocab=12, pad_id=PAD, d_model=16, n_heads=2, d_ff=32,
                              encoder_layers=1, decoder_layers=1, dropout=0.0)).eval()
    step = m.decode_step

    def preferring_specials(*args, **kwargs):
        logits = step(*args, **kwargs).clone()
        logits[:, PAD] += 100.0
        logits[:, BOS] += 90.0
        logits[:, MASK] += 95.0
        return logits

    monkeypatch.setattr(m, "decode_step", preferring_specials)
    src = torch.tensor([[5, 6, 7, EOS], [8, EOS, PAD, PAD]])
    for hyp in (greedy_decode(m, src, BOS, EOS, PAD, 6, never=[MASK]),
                beam_search(m, src, BOS, EOS, PAD, 6, beam_size=3, never=[MASK])[0]):
        for row in hyp.tolist():
            words = row[: row.index(EOS)] if EOS in row else row
            assert PAD not in words and BOS not in words and MASK not in words, row


def test_no_positions_to_decode_is_an_empty_row_and_non_finite_outputs_are_one_error(model):
    """max_len 0 gives empty rows, as greedy decoding does (it raised ValueError: max() arg is an empty sequence);
    a model whose outputs are NaN (a diverged run) is named as such by both decoders."""
    greedy = greedy_decode(model, SRC, BOS, EOS, PAD, max_len=0)
    beam, scores = beam_search(model, SRC, BOS, EOS, PAD, max_len=0, beam_size=3)
    assert beam.shape == greedy.shape == (3, 0) and scores.tolist() == [0.0, 0.0, 0.0]
    # in a batch with other lengths too: nothing for that sentence, the others as if decoded alone
    for decode in (lambda src, n: greedy_decode(model, src, BOS, EOS, PAD, n),
                   lambda src, n: beam_search(model, src, BOS, EOS, PAD, n, beam_size=3)[0]):
        mixed = decode(SRC, [0, 12, 5])
        assert (mixed[0] == PAD).all()
        for i, n in ((1, 12), (2, 5)):
            alone = decode(SRC[i:i + 1], n)[0]
            assert mixed[i, :alone.numel()].tolist() == alone.tolist() and (mixed[i, alone.numel():] == PAD).all()
    broken = reverser(30, 8, steps=0)
    with torch.no_grad():
        broken.generator.weight[5, 0] = float("nan")
    with pytest.raises(NumericalError, match="no hypothesis of sentence 0 has a finite score"):
        beam_search(broken, SRC, BOS, EOS, PAD, max_len=12, beam_size=3)
    with pytest.raises(NumericalError, match="greedy decoding: a sentence's scores are NaN at step 1"):
        greedy_decode(broken, SRC, BOS, EOS, PAD, max_len=12)  # (it wrote the NaN row's argmax)


@pytest.mark.parametrize("beam_size", [1, 3])
def test_no_translation_is_longer_than_the_models_positions(model, beam_size):
    """max_len_a x a long source + max_len_b may pass the decoder's positions (a 1,000-word line wrote 1,511
    tokens under max_positions=1024): translations stop at max_positions, as fairseq's do; None leaves them be."""
    from types import SimpleNamespace

    from src.evaluate import translate_ids

    torch.manual_seed(1)
    sources = [torch.randint(3, 30, (n,)) for n in (2, 8)]
    codec = SimpleNamespace(bos_id=BOS, eos_id=EOS, pad_id=PAD, other_specials=())

    def lengths(max_positions):
        rows = translate_ids(model, sources, codec, codec, torch.device("cpu"), 2, 0.0, 20, beam_size=beam_size,
                             max_positions=max_positions)
        return [len([t for t in row if t != PAD]) for row in rows]

    free, capped = lengths(None), lengths(5)
    assert free[0] == 3 and free[1] > 5  # the reverser writes n words and </s>, or about that
    assert capped == [3, 5]


def test_the_length_penalty_is_gnmts():
    """Wu et al. (2016): lp(Y) = ((5 + |Y|) / 6) ** alpha, by which a hypothesis's log-probability is divided, so
    with alpha > 0 a longer one of the same log-probability scores higher (the exhaustive-search test divides by
    this same function, so it cannot catch a wrong formula)."""
    assert length_penalty(7, 0.6) == pytest.approx(2**0.6) and length_penalty(7, 0.0) == 1.0
    assert -3.0 / length_penalty(9, 0.6) > -3.0 / length_penalty(4, 0.6)


def test_the_unknown_words_of_the_translations_are_counted_up_to_their_end():
    """summary's test_unk_words: every <unk> a translation holds before its </s> (after it, padding's place, none
    is written), in every translation, the last too (a tiny run writes none, so its own check was 0 == 0)."""
    UNK = 3
    hyps = [[5, UNK, 6, EOS, UNK], [UNK, UNK], [], [7, EOS], [UNK, 8, EOS, PAD]]
    assert unknown_words(hyps, EOS, UNK) == 4
