"""The settings ``train.py`` and ``plan.py`` check before any data is read: each mistake as one line naming the key
(a mistake found after tokenizing a large corpus, or after hours of training, is found too late)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from . import planner
from .config_check import check_known_keys, check_presets_are_global
from .data.corpus import check_data
from .errors import ConfigError, check_int, check_number, string_hint
from .faults import check_fault
from .kernels import attention_names, check_matmul_precision
from .model import INITS, ModelArgs, model_fields
from .tokenizers import check_tokenizer

log = logging.getLogger(__name__)


def resolve_device(name: str, key: str = "trainer.device=") -> torch.device:
    """``key``: how the setting is named in the errors (translate.py's is ``--device ``)."""
    if not isinstance(name, str):
        raise ConfigError(f"{key}{name}: expected auto, cpu or cuda")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"{key}{name}: no CUDA device is visible; use {key}cpu (or auto)")
    if name != "cpu" and not name.startswith("cuda"):
        raise ConfigError(f"{key}{name}: expected auto, cpu or cuda")
    try:
        device = torch.device(name)
    except RuntimeError:  # cuda:x
        raise ConfigError(f"{key}{name}: expected auto, cpu, cuda or cuda:<index>") from None
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"{key}{name}: {torch.cuda.device_count()} CUDA device(s) visible, numbered from 0")
    return device


def check_trainer(tr: dict) -> None:
    """The trainer group's settings, each checked before the data is read (a mistake found after tokenizing a large
    corpus, or after hours of training, is found too late)."""
    max_steps, max_epochs = tr.get("max_steps"), tr.get("max_epochs")
    check_int("trainer.max_steps", max_steps, 1, nullable=True)
    check_int("trainer.max_epochs", max_epochs, 1, nullable=True)
    if not max_steps and not max_epochs:
        raise ConfigError("set trainer.max_steps or trainer.max_epochs (or both)")
    for key in ("log_every", "eval_batch_size", "beam_size", "profile_steps", "keep_last"):
        check_int(f"trainer.{key}", tr.get(key), 1)
    for key in ("eval_every", "save_every", "limit_eval", "overfit_batches", "memory_every", "threads",
                "average_last"):
        check_int(f"trainer.{key}", tr.get(key), 1, nullable=True)
    for key in ("num_samples", "max_nonfinite"):
        check_int(f"trainer.{key}", tr.get(key), 0)
    check_int("trainer.profile_from", tr.get("profile_from"), 1, nullable=True)  # its step warms the profiler up
    check_int("trainer.max_len_b", tr.get("max_len_b"), 1)
    check_number("trainer.max_len_a", tr.get("max_len_a"), 0, why=" (decoding stops at max_len_a x source length "
                                                                  "+ max_len_b tokens)")
    check_number("trainer.length_penalty", tr.get("length_penalty"), 0, why=" (0: no length penalty)")
    check_number("trainer.peak_tflops", tr.get("peak_tflops"), 0, strict=True, nullable=True,
                 why=" (one device's datasheet TFLOP/s at the run's precision; null: no MFU)")
    check_number("trainer.gpu_gb", tr.get("gpu_gb"), 0, strict=True, nullable=True,
                 why=" (the GB of the card to train as on; null: the whole device)")
    if tr.get("average_last") and tr["average_last"] > tr["keep_last"]:
        raise ConfigError(f"trainer.average_last={tr['average_last']} needs as many step checkpoints kept: set "
                          f"trainer.keep_last={tr['average_last']} or more (it is {tr['keep_last']})")
    attention_names(tr.get("attention"))
    check_matmul_precision(tr.get("matmul_precision", "highest"))  # absent from configs saved before 2026-12-05
    if tr.get("on_nonfinite") not in ("skip", "stop"):
        raise ConfigError(f"trainer.on_nonfinite={tr.get('on_nonfinite')}: expected skip or stop")


def check_threads(tr: dict) -> None:
    """trainer.threads on the machine that trains (plan.py plans for another): 100,000 crashed PyTorch's thread
    pool (SIGSEGV, no message)."""
    cores = os.cpu_count() or 1
    if tr.get("threads") and tr["threads"] > 4 * cores:
        raise ConfigError(f"trainer.threads={tr['threads']}: this machine has {cores} cores; give at most "
                          f"{4 * cores} (null: PyTorch's default, one per core)")


def check_model(model: dict) -> None:
    """The model group's keys, sizes, rates and initialization (before the data is read)."""
    check_known_keys("model", (k for k in model if k != "name"), model_fields())
    for key in ("d_model", "n_heads", "d_ff", "encoder_layers", "decoder_layers"):
        if key in model:
            check_int(f"model.{key}", model[key], 1)
    check_int("model.max_positions", model.get("max_positions"), 2, nullable=True)
    for key in ("dropout", "attention_dropout", "activation_dropout"):
        if key in model:
            check_number(f"model.{key}", model[key], 0, below=1, nullable=key != "dropout")
    d_model, n_heads = model.get("d_model", ModelArgs.d_model), model.get("n_heads", ModelArgs.n_heads)
    if d_model % n_heads:
        raise ConfigError(f"model.d_model={d_model} must be divisible by model.n_heads={n_heads}")
    if model.get("init", ModelArgs.init) not in INITS:
        raise ConfigError(f"model.init={model['init']}: expected {' or '.join(INITS)}")


def check_optim(optim: dict) -> None:
    """The optimizer group's settings (before the data is read)."""
    check_number("optim.lr", optim.get("lr"), 0, strict=True, nullable=True, why=" (null: the paper's schedule)")
    check_number("optim.lr_factor", optim.get("lr_factor", 1.0), 0, strict=True)
    check_int("optim.warmup_steps", optim.get("warmup_steps"), 0)
    check_number("optim.eps", optim.get("eps"), 0, strict=True)
    check_number("optim.weight_decay", optim.get("weight_decay", 0.0), 0)
    check_number("optim.label_smoothing", optim.get("label_smoothing"), 0, below=1)
    check_number("optim.clip_grad_norm", optim.get("clip_grad_norm"), 0, strict=True, nullable=True,
                 why=" (null: no clipping)")
    betas = optim.get("betas")
    if not isinstance(betas, list | tuple) or len(betas) != 2:
        raise ConfigError(f"optim.betas={betas}: expected two numbers, e.g. [0.9,0.98]")
    for i, beta in enumerate(betas):
        check_number(f"optim.betas[{i}]", beta, 0, below=1)


def check_plan(plan: dict) -> None:
    """The plan group's settings (plan.py, and memory=auto's margins), before the data is read."""
    planner.check_device(plan.get("device", "cuda"))
    check_number("plan.gpu_gb", plan.get("gpu_gb", 12.0), 0, strict=True)
    check_number("plan.overhead", plan.get("overhead", 0.10), 0, why=" (0.10: 10% on top of the estimate)")
    check_number("plan.context_gb", plan.get("context_gb", 0.5), 0)
    for key in ("src_len", "tgt_len", "src_vocab", "tgt_vocab", "world_size"):
        check_int(f"plan.{key}", plan.get(key), 1, nullable=True)


def resolve_config(cfg: DictConfig) -> dict:
    """The config as plain data, every interpolation resolved; a required key left unset or an interpolation that
    does not resolve is one line."""
    try:
        if missing := sorted(OmegaConf.missing_keys(cfg), key=lambda key: _position(cfg, key)):  # all at once
            raise ConfigError("\n".join(f"{key} is required: add {key}=... to the command line" for key in missing))
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except MissingMandatoryValue as e:  # (an interpolation of a required key)
        raise ConfigError(f"{e.full_key} is required: add {e.full_key}=... to the command line") from None
    except OmegaConfBaseException as e:
        raise unresolved(e) from None


def unresolved(e: OmegaConfBaseException) -> ConfigError:
    """One line for a setting that does not resolve. ``${hydra:...}`` (paths.output_dir: Hydra's run directory)
    resolves only in a job Hydra runs: a config composed with Hydra's compose API (a notebook) must set it."""
    key, first = getattr(e, "full_key", None) or "config", str(e).splitlines()[0]
    if "HydraConfig was not set" in first:
        return ConfigError(f"{key}: set by Hydra only when train.py runs; composing the config yourself, give it: "
                           f"compose(config_name='train', overrides=[..., '{key}=outputs/runs/mine'])")
    return ConfigError(f"{key}: {first}")


# settings that name files or folders to read (tokenizer.name_or_path: where it is a folder, not a hub name)
INPUT_PATHS = ("paths.cache_dir", "data.root", "data.train_prefix", "data.valid_prefix", "data.test_prefix",
               "ckpt_path", "tokenizer.name_or_path")


def from_launch_dir(conf: dict) -> dict:
    """With ``hydra.job.chdir=true`` the job runs in its run directory, where a relative input path (``data.root``,
    ``ckpt_path``, ``paths.cache_dir``, ...) named nothing, or a cache of its own: they are taken from the directory
    train.py was started in, as Hydra's ``to_absolute_path`` takes them. Unchanged without chdir."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized() or not HydraConfig.get().job.get("chdir"):
        return conf
    launched = Path(HydraConfig.get().runtime.cwd)
    for dotted in INPUT_PATHS:
        group, _, leaf = dotted.rpartition(".")
        node = conf.get(group) if group else conf
        value = node.get(leaf) if isinstance(node, dict) else None
        if not isinstance(value, str) or not value or Path(value).expanduser().is_absolute():
            continue
        if dotted != "tokenizer.name_or_path" or (launched / value).exists():  # else a hub name (xlm-roberta-base)
            node[leaf] = str(launched / value)
    return conf


def _position(cfg: DictConfig, key: str) -> list[int]:
    """Where a dotted key is in the config, to list keys as the config file does (data=files: its languages, then
    its train, valid and test prefixes)."""
    position, node = [], cfg
    for part in key.split("."):
        keys = list(node.keys()) if isinstance(node, DictConfig) else []
        position.append(keys.index(part) if part in keys else len(keys))
        node = node[part] if part in keys and not OmegaConf.is_missing(node, part) else None  # (a parent: a dict)
    return position


def check_settings(conf: dict) -> None:
    """Every setting that can be checked without the data, in train.py and plan.py alike: the trainer, model,
    optimizer, data, tokenizer and plan groups, and the batch size (memory's are checked by ``memory_strategy``)."""
    check_presets_are_global(conf)
    check_trainer(conf["trainer"])
    check_model(conf["model"])
    check_optim(conf["optim"])
    check_data(conf["data"])
    check_tokenizer(conf["tokenizer"], (conf["data"].get("src_lang"), conf["data"].get("tgt_lang")))
    check_int("data.batch_size", conf["data"].get("batch_size"), 1)
    memory, batch = conf.get("memory") or {}, conf["data"].get("batch_size")
    accum = memory.get("accum_steps")
    if not conf["data"].get("max_tokens") and isinstance(accum, int) and accum > batch:
        raise ConfigError(f"memory.accum_steps={accum}: more micro-batches than the {batch} pairs of data.batch_size; "
                          f"at most {batch} (micro-batches of one pair)")
    card = conf["trainer"].get("gpu_gb")
    if memory.get("auto") and card and (memory.get("budget_gb") or 0) > card:
        log.warning("memory.budget_gb=%s is more than the %s GB of trainer.gpu_gb: memory=auto plans for a larger "
                    "card than the run is capped at", memory["budget_gb"], card)
    if memory.get("budget_gb") is not None and not memory.get("auto"):
        log.warning("memory.budget_gb=%s: read by memory=auto alone; this run's strategy does not fit itself to it "
                    "(plan.py checks a card with plan.gpu_gb)", memory["budget_gb"])
    check_fault(conf.get("fault") or {})
    seed = conf.get("seed")  # torch.manual_seed takes -2**63 to 2**64 - 1
    if not isinstance(seed, int) or isinstance(seed, bool) or not -(2**63) <= seed < 2**63:
        raise ConfigError(f"seed={seed}: must be an integer from -2**63 to 2**63 - 1" + string_hint("seed", seed))
    check_plan(conf.get("plan") or {})
