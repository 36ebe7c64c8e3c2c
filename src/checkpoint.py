"""Checkpoints: written atomically (temporary file, fsync, rename), read with ``weights_only=True`` so a
checkpoint can never run code when it is loaded."""

from __future__ import annotations

import json
import logging
import pickle
from collections.abc import Sequence
from pathlib import Path

import torch

from .errors import UserError
from .fileio import atomic_path

log = logging.getLogger(__name__)


def save_checkpoint(path: Path, **state) -> None:
    """``state`` holds state dicts, numbers, strings and plain containers (what ``weights_only`` accepts)."""
    with atomic_path(path) as tmp:
        torch.save(state, tmp)


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict:
    return torch.load(path, map_location=map_location, weights_only=True)


def checkpoint_step(path: Path, io_errors: bool = False) -> int | None:
    """The training step a checkpoint was written at, read without loading its tensors (memory-mapped); None for
    a file that cannot be read or holds no progress. ``io_errors``: those of the disk or the host's memory, not
    the file's own, are raised."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)["progress"]["step"]
    except (OSError, MemoryError):
        if io_errors:
            raise
        return None
    except Exception:
        return None


def load_translator(path: str | Path | Sequence[str | Path], device: torch.device,
                    tokenizer_dir: str | Path | None = None):
    """(model in eval mode, source codec, target codec, checkpoint) from a run's checkpoint, or from several of one
    run with their weights averaged (the paper's last 5 checkpoints). The tokenizer is read from the run directory
    (``<run>/tokenizer`` beside ``<run>/checkpoints``) unless given."""
    from .model import ModelArgs, Transformer
    from .tokenizers import load_codecs

    paths = [file for p in ([path] if isinstance(path, str | Path) else path)
             for file in checkpoint_files(Path(p).expanduser().resolve())]  # (resolved, whatever the cwd)
    ckpt = averaged_checkpoint(paths, torch.device("cpu"))  # the optimizer's state too: not onto the device
    tokenizer_dir = Path(tokenizer_dir).expanduser() if tokenizer_dir else paths[0].parent.parent / "tokenizer"
    if tokenizer_dir.name == "codecs.json" and tokenizer_dir.is_file():  # the file named rather than its folder
        tokenizer_dir = tokenizer_dir.parent
    if not (tokenizer_dir / "codecs.json").is_file():
        raise UserError(f"{tokenizer_dir}: no tokenizer (codecs.json) found; pass the run's tokenizer directory "
                        "(translate.py --tokenizer <run>/tokenizer: a checkpoint moved out of its run's checkpoints/ "
                        "does not find it beside it)")
    src_codec, tgt_codec = load_codecs(tokenizer_dir)
    args = ckpt["model_args"]
    sizes = {"source": (len(src_codec), args.get("src_vocab")), "target": (len(tgt_codec), args.get("tgt_vocab"))}
    if any(here != there for here, there in sizes.values()):
        raise UserError(f"{tokenizer_dir}: not the tokenizer of {paths[0]} (" + ", ".join(
            f"{side} vocabulary {here} here, {there} in the checkpoint" for side, (here, there) in sizes.items())
            + "); pass that run's tokenizer directory")
    vocab = ckpt.get("vocab")  # what the checkpoint's ids stand for (a tokenizer of the same sizes may differ)
    if vocab and (vocab["src"], vocab["tgt"]) != (src_codec.vocab_digest(), tgt_codec.vocab_digest()):
        raise UserError(f"{tokenizer_dir}: not the tokenizer of {paths[0]} (the same vocabulary sizes, other "
                        "entries); pass that run's tokenizer directory")
    args = {"max_positions": None, **args}  # a checkpoint written before the limit was set has none
    model = Transformer(ModelArgs(**args)).to(device)
    model.load_state_dict(ckpt["model"])
    model.eval()
    return model, src_codec, tgt_codec, ckpt


def checkpoint_files(path: Path) -> list[Path]:
    """The checkpoints a path names: a file, or what a run directory (or its checkpoints/) tested with: the
    checkpoints its summary.json names in ``test_checkpoints`` (the average of the last N with
    trainer.average_last), else its best checkpoint."""
    if not path.is_dir():
        return [path]
    ckpt_dir = path if (path / "best.pt").is_file() and not (path / "checkpoints").is_dir() else path / "checkpoints"
    try:
        tested = json.loads((ckpt_dir.parent / "summary.json").read_text(encoding="utf-8")).get("test_checkpoints")
    except (OSError, ValueError, AttributeError):
        tested = None
    if tested and all((ckpt_dir / name).is_file() for name in tested):
        return [ckpt_dir / name for name in tested]
    if tested and tested != ["best.pt"]:
        log.warning("%s: %s, which the run tested with (summary.json), is missing; best.pt instead, which scores "
                    "otherwise", ckpt_dir, ", ".join(n for n in tested if not (ckpt_dir / n).is_file()))
    if (ckpt_dir / "best.pt").is_file():
        return [ckpt_dir / "best.pt"]
    raise UserError(f"{path}: a directory without checkpoints/best.pt (written at a run's first validation); "
                    "pass a checkpoint file")


def read_checkpoint(path: Path, device: torch.device) -> dict:
    """A checkpoint written by train.py (its model's settings and weights), or one line saying why ``path`` is not."""
    if not path.is_file():
        raise UserError(f"{path}: checkpoint not found")
    try:
        ckpt = load_checkpoint(path, device)
    except Exception as e:
        if not zipped(path):
            raise UserError(f"{path}: not a checkpoint (not a zip archive, as torch.save writes: a text file? "
                            "translate.py takes its sentences with --input)") from None
        raise UserError(f"{path}: not a readable checkpoint ({unreadable_because(e)})") from None
    if not isinstance(ckpt, dict) or not {"model", "model_args"} <= ckpt.keys():
        raise UserError(f"{path}: not a checkpoint written by train.py (it has no model settings and weights: "
                        "a bare state_dict?)")
    return ckpt


def zipped(path: Path) -> bool:
    """Whether ``path`` starts as the zip archives torch.save writes do (a text file given as a checkpoint does not;
    a truncated checkpoint does)."""
    with path.open("rb") as f:
        return f.read(4) == b"PK\x03\x04"


def unreadable_because(e: Exception) -> str:
    """Why ``torch.load(weights_only=True)`` could not read a file, in one line. Not PyTorch's words for a file that
    holds more than tensors and plain values: they advise loading it with weights_only=False, which runs its code."""
    if isinstance(e, pickle.UnpicklingError):
        return "not a checkpoint written by train.py: it holds other data than tensors and plain values, or none"
    # its first sentence: a torn zip's goes on for four about corruption, in every warning and error naming it
    return f"{type(e).__name__}: {str(e).splitlines()[0].split('. ')[0] if str(e) else ''}"


def _run_step(ckpt: dict) -> tuple[str | None, int | None]:
    """The directory of the run that wrote a checkpoint (as it was then: moving the run does not change it) and
    its step; nulls for a checkpoint that does not say."""
    directory = ((ckpt.get("config") or {}).get("paths") or {}).get("output_dir")
    return directory, (ckpt.get("progress") or {}).get("step")


def averaged_checkpoint(paths: Sequence[Path], device: torch.device) -> dict:
    """The first checkpoint, its model weights replaced by the mean of all the checkpoints' (floating-point
    tensors; the rest as in the first). They are read one at a time, however many: in memory at once are the first
    (kept for what the result takes from it, its optimizer state included), the float64 sum (twice the weights) and
    the one being added."""
    first_path, first = paths[0], read_checkpoint(paths[0], device)
    if len(paths) == 1:
        return first
    total = {k: v.double() if v.is_floating_point() else v for k, v in first["model"].items()}
    first_run_step = _run_step(first)
    first_run = first_run_step[0]
    seen = {first_run_step: first_path}
    for path in paths[1:]:
        ckpt = read_checkpoint(path, device)
        if ckpt["model_args"] != first["model_args"]:
            raise UserError(f"{path}: another model than {first_path} (model_args differ); average checkpoints of one run")
        if ckpt.get("vocab") != first.get("vocab"):
            raise UserError(f"{path}: another vocabulary than {first_path} (a run with another tokenizer); average "
                            "checkpoints of one run")
        run_step = _run_step(ckpt)
        if run_step[0] != first_run:
            raise UserError(f"{path}: another run than {first_path} ({run_step[0]}, not {first_run}): the "
                            "weights of separately trained models do not average into a model; average checkpoints "
                            "of one run")
        if run_step in seen and run_step[1] is not None:  # best.pt beside step_*.pt, say
            raise UserError(f"{path}: step {run_step[1]} of the same run as {seen[run_step]} (best.pt is a step "
                            "checkpoint, copied or linked); give each checkpoint once")
        seen[run_step] = path
        for k, v in total.items():
            if v.is_floating_point():
                v += ckpt["model"][k]
        del ckpt
    model = {k: (v / len(paths)).to(first["model"][k].dtype) if v.is_floating_point() else v for k, v in total.items()}
    return dict(first, model=model)
