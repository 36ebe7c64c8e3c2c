"""The encoder-decoder Transformer of "Attention Is All You Need" (Vaswani et al., 2017).

Batch-first throughout. Attention goes through ``F.scaled_dot_product_attention`` so PyTorch picks the
fastest kernel it has for the device. Masks are boolean and mean "may attend" (SDPA's convention).
Incremental decoding keeps a key/value cache per layer, so greedy decoding costs one new position per step; in
beam search the hypotheses of a sentence share its encoder keys and values.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

INITS = ("xavier", "fairseq")  # model.init: see ModelArgs.init


@dataclass(frozen=True)
class ModelArgs:
    src_vocab: int
    tgt_vocab: int
    pad_id: int
    d_model: int = 512
    n_heads: int = 8
    d_ff: int = 2048
    encoder_layers: int = 6
    decoder_layers: int = 6
    dropout: float = 0.1  # on embeddings and on each sublayer's output (the paper's P_drop)
    # Inside attention (on the attention weights) and inside the feed-forward block (after the ReLU); null = the
    # same as ``dropout``. fairseq's defaults are 0 for both; the CPU's fused attention kernel runs only without it.
    attention_dropout: float | None = None
    activation_dropout: float | None = None
    # Tie the decoder's input embedding and the output projection (paper, section 3.4). When source and
    # target share one vocabulary (tokenizer=xlmr), the encoder embedding is shared as well.
    tie_embeddings: bool = True
    share_vocab: bool = False
    # The paper normalizes after each residual block (post-norm); pre-norm trains more stably without warmup.
    norm_first: bool = False
    # Weight initialization. "xavier": Xavier-uniform matrices and PyTorch's default biases (The Annotated
    # Transformer). "fairseq": fairseq's transformer as it was initialized when its attention had one combined
    # query/key/value projection: zero biases, and those projections drawn with gain 1/sqrt(2) (later releases keep
    # PyTorch's default biases there and in the feed-forward layers). Embeddings (and an untied output projection)
    # start from N(0, d_model^-0.5) under both.
    init: str = "xavier"
    # The longest source or target a run accepts, in positions (tokens and their special token), as fairseq's
    # max_source_positions: sinusoidal positions have no limit, but attention over L positions holds L x L scores
    # per head, so one stray line of 100,000 words is refused by name rather than exhausting memory. None: any.
    max_positions: int | None = 1024

    def to_dict(self) -> dict:
        return asdict(self)

    def training_flops(self, pairs: int, src_len: int, tgt_len: int) -> int:
        """Model FLOPs of one training forward and backward pass over ``pairs`` sentence pairs padded to
        ``src_len`` source and ``tgt_len`` target positions, counted as PyTorch's ``FlopCounterMode`` counts
        matrix products (2 per multiply-add; backward twice forward): the linear layers, attention's scores and
        weighted values, the output projection. Unlike that counter, attention is counted also where the CPU's
        fused kernel computes it, which the counter does not see. Not counted: elementwise work, softmax, layer
        norms, the optimizer, and what memory=checkpoint recomputes: the model's FLOPs, not the hardware's."""
        b, s, t, d = pairs, src_len, tgt_len, self.d_model
        linear = 2 * d * (4 * d + 2 * self.d_ff)  # per position: 4 attention projections, 2 feed-forward matrices
        encoder = b * s * linear + 4 * b * s * s * d  # + scores and weighted values, 2 products of s x s x d
        decoder = (b * t * (linear + 4 * d * d)  # + the cross-attention's query and output projections on t,
                   + 4 * b * s * d * d  # its key and value projections on the source,
                   + 4 * b * t * t * d + 4 * b * t * s * d)  # self- and cross-attention
        forward = self.encoder_layers * encoder + self.decoder_layers * decoder + 2 * b * t * d * self.tgt_vocab
        return 3 * forward


def model_fields() -> list[str]:
    """The settings of the model group: ModelArgs' fields but those the run fills in from the tokenizers."""
    return [f for f in ModelArgs.__dataclass_fields__ if f not in ("src_vocab", "tgt_vocab", "pad_id", "share_vocab")]


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"model.d_model={d_model} must be divisible by model.n_heads={n_heads}")
        self.n_heads = n_heads
        self.d_head = d_model // n_heads
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        self.dropout = dropout

    def split_heads(self, x: Tensor) -> Tensor:  # (B, L, D) -> (B, H, L, Dh)
        return x.unflatten(-1, (self.n_heads, self.d_head)).transpose(1, 2)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool = False) -> Tensor:
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, dropout_p=self.dropout if self.training else 0.0
        )
        return self.out_proj(out.transpose(1, 2).flatten(2))

    def forward(self, query: Tensor, key_value: Tensor, mask: Tensor | None, causal: bool = False) -> Tensor:
        q = self.split_heads(self.q_proj(query))
        k = self.split_heads(self.k_proj(key_value))
        v = self.split_heads(self.v_proj(key_value))
        return self.attend(q, k, v, mask, causal)


class Dropout(nn.Dropout):
    """``nn.Dropout``; in training on the CPU, the same operation at a GPU's memory cost and about 3x the speed.

    PyTorch's CPU dropout draws a float mask with ``bernoulli_`` (one Mersenne Twister draw per element, on one
    thread) and keeps that float mask, 4 bytes an element, for backward; CUDA's fused dropout keeps a 1-byte
    boolean mask. Here one 64-bit draw gives the coins of four elements (16 bits each, so the drop probability is
    ``p`` rounded to a multiple of 1/65536), the boolean mask is what backward keeps, and the kept values are
    scaled by 1 / (1 - that probability). So the CPU ledger counts dropout as the GPU keeps it, and the planner,
    which runs on the CPU, plans it so. Random masks differ from ``nn.Dropout``'s; they follow the seed."""

    def forward(self, x: Tensor) -> Tensor:
        dropped = round(self.p * 65536)  # of 65536 equally likely 16-bit values
        if (not self.training or x.device.type != "cpu" or self.inplace or not 0 < dropped < 65536
                or torch.compiler.is_compiling()):  # (Dynamo does not trace random_: a graph break at every dropout)
            return super().forward(x)
        n = x.numel()
        coins = torch.empty((n + 3) // 4, dtype=torch.int64, device=x.device).random_(-(2**63), 2**63 - 1)
        keep = coins.view(torch.int16)[:n].view(x.shape) >= dropped - 32768
        return torch.mul(x, keep).mul_(65536 / (65536 - dropped))


class FeedForward(nn.Module):
    def __init__(self, d_model: int, d_ff: int, dropout: float):
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff)
        self.w2 = nn.Linear(d_ff, d_model)
        self.dropout = Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(self.dropout(F.relu(self.w1(x))))


class Residual(nn.Module):
    """x + dropout(sublayer(x)), normalized after (paper) or before (pre-norm) the sublayer."""

    def __init__(self, d_model: int, dropout: float, norm_first: bool):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.dropout = Dropout(dropout)
        self.norm_first = norm_first

    def forward(self, x: Tensor, sublayer) -> Tensor:
        if self.norm_first:
            return x + self.dropout(sublayer(self.norm(x)))
        return self.norm(x + self.dropout(sublayer(x)))


def inner_dropouts(a: ModelArgs) -> tuple[float, float]:
    return (a.dropout if a.attention_dropout is None else a.attention_dropout,
            a.dropout if a.activation_dropout is None else a.activation_dropout)


class EncoderLayer(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        attn_p, act_p = inner_dropouts(a)
        self.self_attn = MultiHeadAttention(a.d_model, a.n_heads, attn_p)
        self.ff = FeedForward(a.d_model, a.d_ff, act_p)
        self.res_attn = Residual(a.d_model, a.dropout, a.norm_first)
        self.res_ff = Residual(a.d_model, a.dropout, a.norm_first)

    def forward(self, x: Tensor, src_mask: Tensor) -> Tensor:
        x = self.res_attn(x, lambda h: self.self_attn(h, h, src_mask))
        return self.res_ff(x, self.ff)


class DecoderLayer(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        attn_p, act_p = inner_dropouts(a)
        self.self_attn = MultiHeadAttention(a.d_model, a.n_heads, attn_p)
        self.cross_attn = MultiHeadAttention(a.d_model, a.n_heads, attn_p)
        self.ff = FeedForward(a.d_model, a.d_ff, act_p)
        self.res_self = Residual(a.d_model, a.dropout, a.norm_first)
        self.res_cross = Residual(a.d_model, a.dropout, a.norm_first)
        self.res_ff = Residual(a.d_model, a.dropout, a.norm_first)

    def forward(self, y: Tensor, memory: Tensor, src_mask: Tensor) -> Tensor:
        # Right padding: the causal mask alone keeps real positions off the padded ones after them.
        y = self.res_self(y, lambda h: self.self_attn(h, h, None, causal=True))
        y = self.res_cross(y, lambda h: self.cross_attn(h, memory, src_mask))
        return self.res_ff(y, self.ff)

    def step(self, y: Tensor, memory: Tensor, src_mask: Tensor, cache: dict, beams: int = 1) -> Tensor:
        """One new target position ``y`` (B * beams, 1, D), reusing the cached keys and values; ``memory`` and
        ``src_mask`` hold one row per sentence, whose ``beams`` hypotheses are consecutive rows of ``y``. ``memory``
        is read on the first step only, which caches its keys and values: later steps may pass it unselected."""

        def self_attn(h: Tensor) -> Tensor:
            attn = self.self_attn
            k, v = attn.split_heads(attn.k_proj(h)), attn.split_heads(attn.v_proj(h))
            if "k" in cache:
                k, v = torch.cat([cache["k"], k], dim=2), torch.cat([cache["v"], v], dim=2)
            cache["k"], cache["v"] = k, v
            return attn.attend(attn.split_heads(attn.q_proj(h)), k, v, None)

        def cross_attn(h: Tensor) -> Tensor:
            attn = self.cross_attn
            if "mem_k" not in cache:  # the encoder output does not change while decoding
                cache["mem_k"] = attn.split_heads(attn.k_proj(memory))
                cache["mem_v"] = attn.split_heads(attn.v_proj(memory))
            q = attn.split_heads(attn.q_proj(h.reshape(-1, beams, h.size(-1))))  # a sentence's beams: its queries
            return attn.attend(q, cache["mem_k"], cache["mem_v"], src_mask).view_as(h)

        y = self.res_self(y, self_attn)
        y = self.res_cross(y, cross_attn)
        return self.res_ff(y, self.ff)


def sinusoidal_positions(max_len: int, d_model: int) -> Tensor:
    position = torch.arange(max_len, dtype=torch.float32).unsqueeze(1)
    div = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    pe = torch.zeros(max_len, d_model)
    pe[:, 0::2] = torch.sin(position * div)
    pe[:, 1::2] = torch.cos(position * div[: d_model // 2])  # an odd d_model has one cosine fewer
    return pe


def normal_table(rows: int, d_model: int) -> nn.Parameter:
    """A rows x d_model parameter drawn once from N(0, d_model^-0.5), on the current default device. nn.Embedding
    and nn.Linear draw their own initialization first, which this one would overwrite: for XLM-R's 250,002 x 512
    table, a second of a CPU core per draw."""
    return nn.Parameter(torch.empty(rows, d_model).normal_(mean=0.0, std=d_model**-0.5))


class Embedding(nn.Module):
    """Token embedding scaled by sqrt(d_model), plus sinusoidal positions, then dropout; ``tokens``, a table shared
    with another Embedding (one vocabulary for source and target). The positions' table has ``max_len`` rows (the
    model's ``max_positions``, as fairseq sizes its table) and grows if a longer input comes."""

    def __init__(self, vocab: int, d_model: int, pad_id: int, dropout: float, max_len: int = 1024,
                 tokens: nn.Embedding | None = None):
        super().__init__()
        if tokens is None:
            tokens = nn.Embedding(vocab, d_model, padding_idx=pad_id, _weight=normal_table(vocab, d_model))
        self.tokens = tokens
        with torch.no_grad():
            self.tokens.weight[pad_id].zero_()
        self.scale = math.sqrt(d_model)
        self.register_buffer("positions", sinusoidal_positions(max_len, d_model), persistent=False)
        self.dropout = Dropout(dropout)

    def forward(self, ids: Tensor, offset: int = 0) -> Tensor:
        length = ids.size(1)
        if offset + length > self.positions.size(0):  # grow the table instead of failing on long inputs
            self.positions = sinusoidal_positions(2 * (offset + length), self.positions.size(1)).to(
                self.positions.device
            )
        return self.dropout(self.tokens(ids) * self.scale + self.positions[offset : offset + length])


def uncached_autocast(device_type: str):
    """Autocast as it is (memory=amp, or none), without its cache of half-precision weight copies: for a
    checkpointed layer's forward. The cache keeps each weight's cast until the outermost autocast ends (the end of
    forward), for a weight used again; a checkpointed layer saves nothing for backward, and each weight is used
    once a forward pass, so the cache only kept a half-precision copy of every layer's weights alive through
    forward. Under memory=fsdp that is a copy of the whole model's gathered layers on every rank, which the ranks
    do not divide: memory=[fsdp,amp,checkpoint] peaked there, its plan 11.6% under with 4 ranks (model=small, 1 pair
    of 16 tokens: 48.4 MiB tracked, 42.8 planned; experiments/distributed/README.md). The recomputation in backward
    runs under the same settings (checkpoint keeps them), casting each weight as it goes, as it did before."""
    if not torch.is_autocast_enabled(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type, torch.get_autocast_dtype(device_type), cache_enabled=False)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        a = args
        if a.share_vocab and a.src_vocab != a.tgt_vocab:
            raise ValueError("share_vocab needs one vocabulary for source and target")
        rows = a.max_positions or 1024  # no limit: a first table, grown as inputs need
        self.src_embed = Embedding(a.src_vocab, a.d_model, a.pad_id, a.dropout, rows)
        self.tgt_embed = Embedding(a.tgt_vocab, a.d_model, a.pad_id, a.dropout, rows,
                                   tokens=self.src_embed.tokens if a.share_vocab else None)
        self.encoder = nn.ModuleList(EncoderLayer(a) for _ in range(a.encoder_layers))
        self.decoder = nn.ModuleList(DecoderLayer(a) for _ in range(a.decoder_layers))
        # Pre-norm stacks need a final normalization; post-norm layers already end with one.
        self.enc_norm = nn.LayerNorm(a.d_model) if a.norm_first else nn.Identity()
        self.dec_norm = nn.LayerNorm(a.d_model) if a.norm_first else nn.Identity()
        self.generator = nn.Linear(a.d_model, a.tgt_vocab, bias=False, device="meta")  # its weight: below
        # an untied output projection starts like the embedding it would otherwise be (as fairseq does)
        self.generator.weight = self.tgt_embed.tokens.weight if a.tie_embeddings else normal_table(a.tgt_vocab, a.d_model)
        if a.init not in INITS:
            raise ValueError(f"model.init={a.init!r}: expected {' or '.join(INITS)}")
        for name, p in self.named_parameters():
            if "embed" in name or name == "generator.weight":
                continue
            if p.dim() > 1:
                qkv = a.init == "fairseq" and name.rsplit(".", 2)[-2] in ("q_proj", "k_proj", "v_proj")
                nn.init.xavier_uniform_(p, gain=2**-0.5 if qkv else 1.0)
            elif a.init == "fairseq" and name.endswith(".bias") and "norm" not in name:
                nn.init.zeros_(p)
        # memory=checkpoint: keep only each layer's input during training and recompute the layer in backward.
        # A run-time setting, not part of the architecture, so it is not in ModelArgs or the checkpoints.
        self.checkpoint_layers = False

    def _layer(self, layer: nn.Module, *args: Tensor) -> Tensor:
        if self.checkpoint_layers and self.training and torch.is_grad_enabled():
            # Non-reentrant checkpointing restores the RNG state for the recomputation: the same dropout masks.
            with uncached_autocast(args[0].device.type):
                return checkpoint(layer, *args, use_reentrant=False)
        return layer(*args)

    def src_mask(self, src: Tensor) -> Tensor:
        """(B, 1, 1, S): True where the key is a real source token."""
        return (src != self.args.pad_id)[:, None, None, :]

    def encode(self, src: Tensor, src_mask: Tensor) -> Tensor:
        x = self.src_embed(src)
        for layer in self.encoder:
            x = self._layer(layer, x, src_mask)
        return self.enc_norm(x)

    def decode(self, memory: Tensor, src_mask: Tensor, tgt_in: Tensor) -> Tensor:
        """Hidden states of the target positions, (B, T, D); ``generator`` turns them into logits."""
        y = self.tgt_embed(tgt_in)
        for layer in self.decoder:
            y = self._layer(layer, y, memory, src_mask)
        return self.dec_norm(y)

    def hidden(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """Final decoder states (B, T, D), before the output projection."""
        src_mask = self.src_mask(src)
        return self.decode(self.encode(src, src_mask), src_mask, tgt_in)

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """Logits (B, T, vocabulary)."""
        return self.generator(self.hidden(src, tgt_in))

    def decode_step(
        self, memory: Tensor, src_mask: Tensor, tokens: Tensor, caches: list[dict], beams: int = 1
    ) -> Tensor:
        """Logits for the next position given the newest tokens (B * beams, 1) and the per-layer caches. With
        ``beams`` > 1, each sentence of ``memory`` (B, S, D) has that many consecutive rows of hypotheses, which
        attend to its encoder keys and values together: these are computed and cached once per sentence.

        Under autocast the logits are computed in fp32 (one position per hypothesis: little work). In bf16, whose 8
        bits of mantissa tie the two best logits every few hundred tokens, greedy decoding (argmax: the lowest id)
        and one beam (topk) broke such ties differently, and one beam was not greedy decoding."""
        position = caches[0]["k"].size(2) if caches and "k" in caches[0] else 0
        y = self.tgt_embed(tokens, offset=position)
        for layer, cache in zip(self.decoder, caches):
            y = layer.step(y, memory, src_mask, cache, beams)
        y = self.dec_norm(y)[:, -1]
        if not torch.is_autocast_enabled(y.device.type):
            return self.generator(y)
        with torch.autocast(y.device.type, enabled=False):
            return F.linear(y.float(), self.generator.weight.float())

    @staticmethod
    def reorder_cache(caches: list[dict], rows: Tensor, sentences: Tensor | None = None) -> None:
        """Select and reorder the decoding caches in place: the self-attention keys and values by hypothesis
        (``rows``), the encoder keys and values by sentence (``sentences``; None leaves them as they are)."""
        for cache in caches:
            for key in ("k", "v"):
                cache[key] = cache[key][rows]
            if sentences is not None:
                for key in ("mem_k", "mem_v"):
                    cache[key] = cache[key][sentences]

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())  # shared tensors are counted once
