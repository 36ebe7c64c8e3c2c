"""Checkpoints: written atomically (temporary file, fsync, rename), read with ``weights_only=True`` so a
checkpoint can never run code when it is loaded."""

from __future__ import annotations

from pathlib import Path

import torch

from .fileio import atomic_path


def save_checkpoint(path: Path, **state) -> None:
    """``state`` holds state dicts, numbers, strings and plain containers (what ``weights_only`` accepts)."""
    with atomic_path(path) as tmp:
        torch.save(state, tmp)


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict:
    return torch.load(path, map_location=map_location, weights_only=True)


def load_translator(path: str | Path, device: torch.device, tokenizer_dir: str | Path | None = None):
    """(model in eval mode, source codec, target codec, checkpoint) from a run's checkpoint. The tokenizer is
    read from the run directory (``<run>/tokenizer`` beside ``<run>/checkpoints``) unless given."""
    from .errors import UserError
    from .model import ModelArgs, Transformer
    from .tokenizers import load_codecs

    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: checkpoint not found")
    try:
        ckpt = load_checkpoint(path, device)
    except Exception as e:
        raise UserError(f"{path}: not a readable checkpoint ({type(e).__name__}: {str(e).splitlines()[0]})") from None
    tokenizer_dir = Path(tokenizer_dir) if tokenizer_dir else path.parent.parent / "tokenizer"
    if not (tokenizer_dir / "codecs.json").is_file():
        raise UserError(f"{tokenizer_dir}: no tokenizer (codecs.json) found; pass the run's tokenizer directory")
    src_codec, tgt_codec = load_codecs(tokenizer_dir)
    model = Transformer(ModelArgs(**ckpt["model_args"])).to(device)
    model.load_state_dict(ckpt["model"])
    model.eval()
    return model, src_codec, tgt_codec, ckpt
