"""The Transformer: masks do what they claim, the layers compute what PyTorch's compute, the KV cache equals the full
forward pass, sizes match the paper."""

import math

import pytest
import torch

from src.evaluate import greedy_decode
from src.model import Dropout, ModelArgs, Transformer

PAD = 1


def tiny(**kw):
    torch.manual_seed(0)
    args = dict(src_vocab=50, tgt_vocab=40, pad_id=PAD, d_model=32, n_heads=4, d_ff=64, encoder_layers=2,
                decoder_layers=2, dropout=0.0)
    return Transformer(ModelArgs(**(args | kw))).eval()


def test_padding_does_not_change_real_positions():
    model = tiny()
    src = torch.tensor([[5, 6, 7, 2]])
    tgt = torch.tensor([[0, 8, 9]])
    alone = model(src, tgt)
    padded = model(torch.tensor([[5, 6, 7, 2, PAD, PAD, PAD]]), torch.tensor([[0, 8, 9, PAD, PAD]]))
    torch.testing.assert_close(padded[:, :3], alone, rtol=1e-5, atol=1e-6)
    batch = model(torch.tensor([[5, 6, 7, 2, PAD], [4, 4, 4, 4, 2]]), torch.tensor([[0, 8, 9], [0, 3, 3]]))
    torch.testing.assert_close(batch[:1], alone, rtol=1e-5, atol=1e-6)


def test_decoder_is_causal():
    model = tiny()
    src = torch.tensor([[5, 6, 7, 2]])
    a = model(src, torch.tensor([[0, 8, 9, 10]]))
    b = model(src, torch.tensor([[0, 8, 30, 31]]))
    torch.testing.assert_close(a[:, :2], b[:, :2])
    assert not torch.allclose(a[:, 2:], b[:, 2:])


def test_kv_cache_decoding_equals_the_full_forward_pass():
    for norm_first in (False, True):
        model = tiny(norm_first=norm_first)
        src = torch.tensor([[5, 6, 7, 8, 2], [9, 10, 2, PAD, PAD]])
        tgt = torch.tensor([[0, 11, 12, 13, 14], [0, 15, 16, 17, 18]])
        full = model(src, tgt)
        mask = model.src_mask(src)
        memory = model.encode(src, mask)
        caches = [{} for _ in model.decoder]
        steps = [model.decode_step(memory, mask, tgt[:, t : t + 1], caches) for t in range(tgt.size(1))]
        torch.testing.assert_close(torch.stack(steps, 1), full, rtol=1e-5, atol=1e-5)
        # greedy decoding follows the argmax of the full pass fed with its own output, over the tokens a
        # translation may hold (not <s> or padding)
        hyp = greedy_decode(model, src, bos_id=0, eos_id=2, pad_id=PAD, max_len=6)
        prefix = torch.cat([torch.zeros(2, 1, dtype=torch.long), hyp[:, :-1]], 1)
        expected = model(src, prefix).index_fill(-1, torch.tensor([0, PAD]), float("-inf")).argmax(-1)
        for row in range(2):
            n = (hyp[row] == 2).nonzero()
            n = int(n[0]) + 1 if len(n) else hyp.size(1)
            assert torch.equal(hyp[row, :n], expected[row, :n])


def test_beams_of_a_sentence_share_its_encoder_keys_and_give_the_full_pass_of_each_hypothesis():
    """decode_step with ``beams``: three hypotheses per sentence, different targets, read one copy of their
    sentence's encoder keys and values and get the logits the full pass gives each (sentence, target) pair."""
    model = tiny()
    src = torch.tensor([[5, 6, 7, 8, 2], [9, 10, 2, PAD, PAD]])
    tgt = torch.tensor([[0, 11, 12, 13], [0, 14, 15, 16], [0, 17, 18, 19]] * 2)  # (sentence, beam) rows
    full = model(src.repeat_interleave(3, dim=0), tgt)
    mask = model.src_mask(src)
    memory = model.encode(src, mask)
    caches = [{} for _ in model.decoder]
    steps = [model.decode_step(memory, mask, tgt[:, t : t + 1], caches, beams=3) for t in range(tgt.size(1))]
    torch.testing.assert_close(torch.stack(steps, 1), full, rtol=1e-5, atol=1e-5)
    assert caches[0]["mem_k"].size(0) == 2 and caches[0]["k"].size(0) == 6


def test_tied_and_shared_embeddings():
    model = tiny(tie_embeddings=True)
    assert model.generator.weight is model.tgt_embed.tokens.weight
    assert model.src_embed.tokens.weight is not model.tgt_embed.tokens.weight
    shared = tiny(src_vocab=40, tie_embeddings=True, share_vocab=True)
    assert shared.src_embed.tokens.weight is shared.tgt_embed.tokens.weight is shared.generator.weight


def test_embedding_and_output_tables_start_from_normal_d_model_to_the_minus_half():
    """Each token table, and an untied output projection, is drawn once from N(0, d_model^-0.5) (the paper's
    scaled embeddings; fairseq's start), with the padding row zero; under a meta device nothing is allocated."""
    torch.manual_seed(0)
    for tie in (True, False):
        model = Transformer(ModelArgs(src_vocab=3000, tgt_vocab=2000, pad_id=PAD, d_model=64, n_heads=4, d_ff=128,
                                      encoder_layers=1, decoder_layers=1, tie_embeddings=tie))
        tables = [model.src_embed.tokens.weight, model.tgt_embed.tokens.weight, model.generator.weight]
        for table in tables:
            assert table.shape[1] == 64 and abs(table.std().item() - 64**-0.5) < 0.005
            assert abs(table.mean().item()) < 0.002
        assert not tables[0][PAD].any() and not tables[1][PAD].any()
        assert (tables[2] is tables[1]) == tie and tables[2][PAD].any() != tie  # an untied row of pad is learned
    with torch.device("meta"):
        model = Transformer(ModelArgs(src_vocab=250_002, tgt_vocab=250_002, pad_id=PAD, share_vocab=True))
    assert {p.device.type for p in model.parameters()} == {"meta"}


def test_base_model_has_the_papers_parameter_count():
    # Paper, table 3: base model 65M parameters, with a shared source-target BPE vocabulary of about 37,000.
    # Counted on the meta device: drawing big's 213M initial values took 5 s on 2 AVX2 cores.
    with torch.device("meta"):
        model = Transformer(ModelArgs(src_vocab=37000, tgt_vocab=37000, pad_id=PAD, share_vocab=True))
        big = Transformer(ModelArgs(src_vocab=37000, tgt_vocab=37000, pad_id=PAD, share_vocab=True, d_model=1024,
                                    n_heads=16, d_ff=4096))
    assert 60e6 < model.num_parameters() < 66e6
    assert 205e6 < big.num_parameters() < 220e6  # paper: 213M


def test_batched_greedy_decoding_equals_decoding_each_sentence_alone():
    """Sentences that finish leave the batch; the others must not notice: each row equals its own decode."""
    g = torch.Generator().manual_seed(3)
    src = torch.randint(4, 50, (12, 7), generator=g)
    src[:, -1] = 2

    def ends(batch: torch.Tensor, eos: int) -> list:
        return [int(e[0]) if len(e := (row == eos).nonzero()) else None for row in batch]

    # a random model and an end-of-sentence token it produces at different steps for different rows, not in all
    found = False
    for seed in range(10):
        model = tiny()
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0, 0.5)  # livelier than the initialization: outputs that change along the way
        for eos in range(4, 40):
            batch = greedy_decode(model, src, bos_id=0, eos_id=eos, pad_id=PAD, max_len=10)
            stops = ends(batch, eos)
            if len({s for s in stops if s is not None}) > 1 and None in stops:
                found = True
                break
        if found:
            break
    assert found, "no token ends some rows early and others late"
    for i in range(src.size(0)):
        alone = greedy_decode(model, src[i : i + 1], bos_id=0, eos_id=eos, pad_id=PAD, max_len=10)[0]
        row = batch[i, : alone.numel()]
        assert torch.equal(row, alone), i
        assert (batch[i, alone.numel():] == PAD).all()


def test_fairseq_initialization():
    """model.init=fairseq: zero biases outside LayerNorm, and query/key/value weights drawn with gain 1/sqrt(2)
    (Xavier-uniform bound sqrt(6 / (2 d)) / sqrt(2)); the rest as with init=xavier."""
    torch.manual_seed(0)
    args = dict(src_vocab=500, tgt_vocab=400, pad_id=PAD, d_model=256, n_heads=4, d_ff=512, encoder_layers=1,
                decoder_layers=1)
    xavier, fairseq = (Transformer(ModelArgs(**args, init=init)) for init in ("xavier", "fairseq"))
    bound = (6 / (2 * 256)) ** 0.5
    for name, p in fairseq.named_parameters():
        if name.endswith(".bias") and "norm" not in name:
            assert not p.any(), name
    for model, gain in ((xavier, 1.0), (fairseq, 2**-0.5)):
        q = model.encoder[0].self_attn.q_proj.weight
        assert gain * bound * 0.98 < q.abs().max() <= gain * bound
        assert model.encoder[0].self_attn.out_proj.weight.abs().max() > 0.98 * bound
    assert xavier.encoder[0].ff.w1.bias.abs().max() > 0  # PyTorch's default biases under init=xavier
    with pytest.raises(ValueError, match="model.init='normal'"):
        Transformer(ModelArgs(**args, init="normal"))


def test_cpu_dropout_drops_p_scales_the_rest_and_keeps_a_boolean_mask_for_backward():
    torch.manual_seed(0)
    drop = Dropout(0.1)
    x = torch.randn(1000, 1001, requires_grad=True)  # an odd size: the last 64-bit draw is cut
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = drop(x)
    keep = y != 0
    assert abs(1 - keep.float().mean().item() - 0.1) < 0.002  # 1e6 coins: the standard error is 3e-4
    scale = 65536 / (65536 - 6554)  # 0.1 of 65536 values, rounded
    torch.testing.assert_close(y[keep], x[keep] * scale)
    assert [(t.dtype, t.shape) for t in saved] == [(torch.bool, x.shape)]  # 1 byte an element, as CUDA keeps it
    y.backward(torch.ones_like(y))
    torch.testing.assert_close(x.grad, keep.float() * scale)

    masks = []
    for _ in range(2):
        torch.manual_seed(1)
        masks.append(drop(x.detach()) != 0)
    assert torch.equal(*masks) and not torch.equal(masks[0], keep)  # the generator's state decides the mask
    assert torch.equal(drop.eval()(x), x)


def _torch_reference(model: Transformer) -> tuple[torch.nn.TransformerEncoder, torch.nn.TransformerDecoder]:
    """PyTorch's own encoder and decoder layers (``nn.TransformerEncoderLayer``, the layers of ``nn.Transformer``),
    holding this model's weights: the query, key and value projections packed into ``in_proj``."""
    a = model.args
    nn = torch.nn
    layer = dict(d_model=a.d_model, nhead=a.n_heads, dim_feedforward=a.d_ff, dropout=0.0, batch_first=True,
                 norm_first=a.norm_first)
    final = (lambda: nn.LayerNorm(a.d_model)) if a.norm_first else (lambda: None)  # nn.Transformer always has one
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(**layer), a.encoder_layers, norm=final(),
                                    enable_nested_tensor=False)
    decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(**layer), a.decoder_layers, norm=final())

    def attention(theirs, ours):
        theirs.in_proj_weight.copy_(torch.cat([ours.q_proj.weight, ours.k_proj.weight, ours.v_proj.weight]))
        theirs.in_proj_bias.copy_(torch.cat([ours.q_proj.bias, ours.k_proj.bias, ours.v_proj.bias]))
        theirs.out_proj.load_state_dict(ours.out_proj.state_dict())

    def block(theirs, ours, attentions, residuals):
        for t, o in attentions:
            attention(t, o)
        theirs.linear1.load_state_dict(ours.ff.w1.state_dict())
        theirs.linear2.load_state_dict(ours.ff.w2.state_dict())
        for i, res in enumerate(residuals, 1):
            getattr(theirs, f"norm{i}").load_state_dict(res.norm.state_dict())

    with torch.no_grad():
        for t, o in zip(encoder.layers, model.encoder):
            block(t, o, [(t.self_attn, o.self_attn)], [o.res_attn, o.res_ff])
        for t, o in zip(decoder.layers, model.decoder):
            block(t, o, [(t.self_attn, o.self_attn), (t.multihead_attn, o.cross_attn)], [o.res_self, o.res_cross, o.res_ff])
        if a.norm_first:
            encoder.norm.load_state_dict(model.enc_norm.state_dict())
            decoder.norm.load_state_dict(model.dec_norm.state_dict())
    return encoder.eval(), decoder.eval()


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm (the paper)", "pre-norm"])
def test_layers_compute_what_pytorchs_transformer_layers_compute_with_the_same_weights(norm_first):
    """The architecture is the paper's as PyTorch implements it: the same weights in ``nn.TransformerEncoderLayer``
    and ``nn.TransformerDecoderLayer`` (key padding masks, a causal target mask) give the same logits, gradients
    included, over a batch padded on both sides."""
    model = tiny(norm_first=norm_first, init="fairseq")  # fairseq's init: zero biases; perturbed below
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))  # no zero bias or unit norm weight left to hide a swapped tensor
    encoder, decoder = _torch_reference(model)
    src = torch.tensor([[5, 6, 7, 8, 2], [9, 10, 2, PAD, PAD]])
    tgt = torch.tensor([[0, 11, 12, 13], [0, 14, PAD, PAD]])
    ours = model(src, tgt)
    pad = src == PAD
    memory = encoder(model.src_embed(src), src_key_padding_mask=pad)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(tgt.size(1), dtype=torch.bool)
    hidden = decoder(model.tgt_embed(tgt), memory, tgt_mask=causal, tgt_is_causal=True, memory_key_padding_mask=pad)
    theirs = model.generator(hidden)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    grad_ours = torch.autograd.grad(ours.square().sum(), model.src_embed.tokens.weight)[0]
    grad_theirs = torch.autograd.grad(theirs.square().sum(), model.src_embed.tokens.weight)[0]
    torch.testing.assert_close(grad_ours, grad_theirs, rtol=1e-4, atol=1e-5)


def test_embeddings_are_scaled_by_the_root_of_d_model_and_add_the_papers_positions():
    """Section 3.4 and 3.5: token embeddings times sqrt(d_model), plus PE(pos, 2i) = sin(pos / 10000^(2i/d)) and
    PE(pos, 2i+1) = cos(pos / 10000^(2i/d)); from an offset (decoding one token at a time), that position's."""
    from src.model import Embedding, sinusoidal_positions

    pe = sinusoidal_positions(3, 4)
    assert torch.allclose(pe[1], torch.tensor([math.sin(1), math.cos(1), math.sin(1e-2), math.cos(1e-2)]))
    embed = Embedding(vocab=10, d_model=16, pad_id=1, dropout=0.0)
    ids = torch.tensor([[4, 7, 2]])
    expected = embed.tokens.weight[ids] * 4.0 + sinusoidal_positions(3, 16)
    torch.testing.assert_close(embed(ids), expected)
    torch.testing.assert_close(embed(ids[:, 2:], offset=2), expected[:, 2:])
    # past the table made at construction (the model's max_positions rows; here 4): it grows, and positions go on as
    # the formula has
    short = Embedding(vocab=10, d_model=16, pad_id=1, dropout=0.0, max_len=4)
    long_ids = torch.randint(2, 10, (2, 9))
    torch.testing.assert_close(short(long_ids), short.tokens.weight[long_ids] * 4.0 + sinusoidal_positions(9, 16))
    torch.testing.assert_close(short(long_ids[:, 8:], offset=20), short.tokens.weight[long_ids[:, 8:]] * 4.0
                               + sinusoidal_positions(21, 16)[20:])


def test_the_position_tables_hold_max_positions_rows():
    """Each side's sinusoidal table has the rows the model accepts (fairseq sizes its table so), not a fixed 4,096:
    for model=base's 1,024 positions, 12 MiB less of buffers on the device; with no limit, 1,024 rows that grow."""
    for limit, rows in ((64, 64), (1024, 1024), (None, 1024)):
        model = tiny(max_positions=limit)
        assert [e.positions.shape for e in (model.src_embed, model.tgt_embed)] == [(rows, model.args.d_model)] * 2
