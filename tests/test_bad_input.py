"""Every kind of bad input in docs/bad_input.md, tried: each gives one line naming the key, file or line and what
to do, before training starts. The table in the docs is checked against these cases, row for row."""

import gzip
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from src.config_check import check_command_line
from src.distributed import World
from src.errors import UserError
from src.run import train

from .conftest import FAST, FAST_TRAIN, ROOT, compose_config
from .helpers import run_cli

DOC = ROOT / "docs" / "bad_input.md"
README = ROOT / "README.md"

DIRECTORY = object()  # in FILES: a folder in the file's place

# (what was tried, the overrides, the message's start); {data} is a folder of small parallel files, {readme} this
# repository's README.md
COMMAND_LINE = [
    ("mistyped key", ["model.dmodel=5"], "model.dmodel: no such key; did you mean model.d_model?"),
    ("unknown option of a group", ["memory=amd"], "memory=amd: no such option; memory is one of accum, amp, auto"),
    ("unknown option in a list of a group's options", ["memory=[amp,acum]"],
     "memory=acum: no such option; memory is one of accum, amp, auto"),
    ("a key of another option of the group", ["data=multi30k", "data.train_size=100"],
     "data.train_size: no such key in the data option chosen; it is a setting of data=synthetic"),
    ("value of the wrong type", ["trainer.max_steps=abc"], "trainer.max_steps=abc: expected an integer"),
    ("a boolean for an integer", ["trainer.max_steps=true"], "trainer.max_steps=true: expected an integer"),
    ("flag that is not true or false", ["memory.checkpoint=yes"], "memory.checkpoint=yes: expected true or false"),
    ("top-level value of the wrong type", ["seed=abc"], "seed=abc: expected an integer"),
    ("a flag given where a number is expected", ["optim.label_smoothing=true"],
     "optim.label_smoothing=true: expected a number (the default is 0.1)"),
    ("a flag set to null", ["model.tie_embeddings=null"], "model.tie_embeddings=null: expected true or false"),
    ("a launcher's or Hydra's setting of the wrong type",  # was "no such key"
     ["-m", "hydra/launcher=slurm", "hydra.launcher.timeout_min=90.5", "memory=none,amp"],
     "hydra.launcher.timeout_min=90.5: Value '90.5' of type 'float' could not be converted to Integer"),
    ("a sweep without -m", ["memory=amp,accum"], "memory=amp,accum: a list of values is a sweep; add -m"),
    ("override without a value", ["memory.accum_steps"], "Error parsing override 'memory.accum_steps': missing EQUAL "
     "at '<EOF>' (overrides are key=value)"),
    ("an interpolation inside an interpolation, unquoted", ["trainer.max_steps=${oc.decode:${oc.env:STEPS}}"],
     "Error parsing override 'trainer.max_steps=${oc.decode:${oc.env:STEPS}}': extraneous input '}' expecting <EOF>; "
     "quote an interpolation inside one: 'key=\"${oc.decode:${oc.env:NAME}}\"'"),
    ("a path starting with an unquoted ~", ["data=multi30k", "data.root=~/multi30k"],
     "data.root=~/multi30k: a bare ~ is not allowed in an override; write data.root=$HOME/multi30k or quote it"),
    ("two mistyped keys", ["model.dmodel=5", "model.nhead=2"],  # every problem, a line each
     "model.dmodel: no such key; did you mean model.d_model?\n"
     "model.nhead: no such key; did you mean model.n_heads?"),
    # the keys under an option that does not exist are checked once it is fixed; the other values are checked now
    ("an unknown option, a key of it and a value of the wrong type",
     ["memory=amd", "memory.accum_steps=2", "trainer.max_steps=abc"],
     "memory=amd: no such option; memory is one of accum, amp, auto, checkpoint, chunked_ce, fsdp, none, tokens, "
     "trim_vocab, truncate\ntrainer.max_steps=abc: expected an integer"),
    ("unknown launcher", ["-m", "hydra/launcher=nope"],
     "hydra/launcher=nope: no such option; hydra/launcher is one of basic, local, slurm, submitit_local, submitit_slurm"),
    ("a key under a key that has none", ["trainer.foo.bar=1"], "trainer.foo: no such key; trainer has device, "),
    ("a list setting given one word", ["tags=memory"], "tags=memory: expected a list, e.g. tags=[memory]"),
    ("unknown memory setting added with +", ["+memory.acum_steps=2"],
     "+memory.acum_steps=2: nothing reads memory.acum_steps; did you mean memory.accum_steps?"),
    ("a key added with + that nothing reads", ["+trainer.foo=1"], "+trainer.foo=1: nothing reads trainer.foo; trainer has"),
    ("a top-level key of one's own", ["+run_name=foo"],
     "+run_name=foo: nothing reads run_name; keys of one's own go under meta: +meta.run_name=foo"),
    ("a key of one's own set without +", ["meta.run_name=foo"],
     "meta.run_name: not there yet; add it with +: +meta.run_name=..."),
    ("a model setting added with +", ["++model.dmodel=5"], "++model.dmodel=5: nothing reads model.dmodel; did you mean "
     "model.d_model?"),
    ("a group set to null", ["experiment=null"], "experiment=null: a group takes its options (experiment is one of "
     "memory_sweep, multi30k_small, paper_base, throughput_ref); leave experiment out for no preset"),
    ("a group's option chosen with +", ["+memory=amp"], "+memory=amp: memory is chosen without +: memory=amp"),
    ("a key that is there added with +", ["+seed=5"], "+seed=5: seed is there already; set it without +: seed=5"),
    ("a null key deleted with ~", ["~memory.amp"], "~memory.amp: memory.amp is null already; nothing to delete"),
    ("a setting deleted with ~", ["~trainer.log_every"],  # the run said trainer.log_every=None
     "~trainer.log_every: the run reads trainer.log_every; set it instead (trainer.log_every=..., the default is 25)"),
    ("a group deleted with ~", ["~logger"],  # a KeyError traceback once the run began
     "~logger: every run needs an option of logger; choose one instead (logger is one of none, wandb)"),
    ("-m with --cfg", ["-m", "--cfg", "job", "memory=amp,accum"],  # Hydra's ValueError traceback
     "-m with --cfg: Hydra takes one or the other; leave -m out and give one job's values (--cfg shows that job's "
     "config and runs nothing)"),
    ("a sweep with --cfg", ["--cfg", "job", "memory=amp,accum"],  # Hydra's "Ambiguous value", over four lines
     "memory=amp,accum: --cfg describes one job; give one of the values"),
    ("Hydra's --experimental-rerun", ["--experimental-rerun", "outputs/runs/1/.hydra/config.pickle"],
     "--experimental-rerun: Hydra's rerun goes back into the old run's directory, whose checkpoints a run does not "
     "overwrite; run it again from the config it saved: python train.py --config-path <run>/.hydra --config-name "
     "config hydra.run.dir=<new directory> (README: Experiment presets)"),
    ("a group's name set instead of its option", ["data.name=multi30k"],
     "data.name=multi30k: data.name names the option chosen; choose it with data=multi30k"),
]
RUN = [
    ("an environment variable that is not set", ["trainer.max_steps=${oc.env:MT_NOT_SET}"],
     "trainer.max_steps: KeyError raised while resolving interpolation: \"Environment variable 'MT_NOT_SET' not found\""),
    ("a number read from an environment variable", ["seed=${oc.env:MT_NOT_SET,3}"],  # oc.env gives strings
     "seed=3: must be an integer from -2**63 to 2**63 - 1 ('3' is a string: read an environment variable as a number "
     "with 'seed=\"${oc.decode:${oc.env:NAME}}\"')"),
    ("accumulation below 1", ["memory.accum_steps=0"], "memory.accum_steps=0: must be an integer >= 1"),
    ("length limit below 1", ["memory.max_src_len=0"], "memory.max_src_len=0: must be an integer >= 1, or null"),
    ("unknown amp dtype", ["memory.amp=fp8"], "memory.amp=fp8: expected bf16, fp16 or null"),
    ("token budget below the longest pair", ["memory=tokens", "data.max_tokens=10"],
     "data.max_tokens=10 is smaller than the longest training pair"),
    ("batch size 0", ["data.batch_size=0"], "data.batch_size=0: must be an integer >= 1"),
    ("heads that do not divide d_model", ["model.d_model=130"], "model.d_model=130 must be divisible by model.n_heads=4"),
    ("unknown initialization", ["model.init=normal"], "model.init=normal: expected xavier or fairseq"),
    ("memory=fsdp without torchrun", ["memory=fsdp"], "memory=fsdp shards over 2 or more ranks of torchrun (this run has 1)"),
    ("out-of-memory back-off under memory=fsdp", ["memory=fsdp", "memory.oom_retries=2"],
     "memory.oom_retries=2 with memory=fsdp: FSDP reduce-scatters gradients inside every backward pass"),
    ("bf16 parameters under FSDP without amp", ["memory=fsdp", "memory.fsdp_param_dtype=bf16"],
     "memory.fsdp_param_dtype=bf16: expected bf16 with memory=[fsdp,amp] and memory.amp=bf16"),
    ("fp16 parameters under FSDP", ["memory=[fsdp,amp]", "memory.amp=fp16", "memory.fsdp_param_dtype=fp16"],
     "memory.fsdp_param_dtype=fp16: expected bf16 with memory=[fsdp,amp] and memory.amp=bf16"),
    ("no step or epoch limit", ["trainer.max_steps=null"], "set trainer.max_steps or trainer.max_epochs"),
    ("memory=auto without a budget", ["memory=auto"], "memory.budget_gb=None: memory=auto needs the memory budget"),
    ("memory=auto with an infinite budget", ["memory=auto", "memory.budget_gb=inf"],
     "memory.budget_gb=inf: memory=auto needs the memory budget in GB"),
    ("more micro-batches than pairs", ["memory=accum", "data.batch_size=64", "memory.accum_steps=100"],
     "memory.accum_steps=100: more micro-batches than the 64 pairs of data.batch_size; at most 64"),
    ("resume from a missing checkpoint", ["ckpt_path=/nonexistent.pt"], "ckpt_path=/nonexistent.pt: no such file"),
    ("resume from a file that is not a checkpoint", ["ckpt_path={readme}"],
     "ckpt_path={readme}: not a readable checkpoint (not a zip archive, as torch.save writes: a text file?)"),
    ("a seed of null", ["seed=null"], "seed=None: must be an integer from -2**63 to 2**63 - 1"),
    ("a seed beyond PyTorch's range", ["seed=18446744073709551616"],
     "seed=18446744073709551616: must be an integer from -2**63 to 2**63 - 1"),
    ("no device", ["trainer.device=null"], "trainer.device=None: expected auto, cpu or cuda"),
    ("more threads than the machine can run", ["trainer.threads=100000"], "trainer.threads=100000: this machine has"),
    ("a W&B tag longer than 64 characters", ["logger=wandb", f"tags=[{'x' * 65}]"],
     f"tags=['{'x' * 65}']: a W&B tag has 1 to 64 characters; '{'x' * 65}' has 65"),
    ("a W&B mode mistyped (WANDB_MODE set too)", ["logger=wandb", "logger.wandb.mode=onlne"],
     "logger.wandb.mode=onlne: expected one of online, offline, disabled, shared, dryrun, run; did you mean online?"),
    ("a W&B project name W&B refuses", ["logger=wandb", "logger.wandb.project=my/proj"],
     "logger.wandb.project=my/proj: Invalid project name 'my/proj': cannot contain characters"),
    ("a vocabulary threshold above every word's count", ["tokenizer.min_freq=100000"],
     "tokenizer.min_freq=100000: no de word of the training text is seen that often, so its vocabulary holds the "
     "special tokens alone; lower it"),
    ("a spaCy pipeline that is a file", ["+tokenizer.models.de={readme}"],
     "tokenizer.models.de={readme}: not a directory; give a pipeline directory written by nlp.to_disk, or an "
     "installed pipeline's name"),
    ("a fault injected at step 0", ["fault.kind=error", "fault.at_step=0"], "fault.at_step=0: must be an integer >= 1"),
    ("unknown resume setting", ["trainer.resume=yes"], "trainer.resume=yes: expected auto, never or null"),
    ("unknown non-finite policy", ["trainer.on_nonfinite=ignore"], "trainer.on_nonfinite=ignore: expected skip or stop"),
    ("memory counted every 0 steps", ["trainer.memory_every=0"], "trainer.memory_every=0: must be an integer >= 1, or null"),
    ("overfit on no batches", ["trainer.overfit_batches=0"], "trainer.overfit_batches=0: must be an integer >= 1, or null"),
    ("overfit on more batches than the data makes", ["trainer.overfit_batches=50"],
     "trainer.overfit_batches=50: the training data makes only 19 batches"),
    ("evaluation on no pairs", ["trainer.limit_eval=0"], "trainer.limit_eval=0: must be an integer >= 1, or null"),
    ("no beams", ["trainer.beam_size=0"], "trainer.beam_size=0: must be an integer >= 1"),
    ("negative length penalty", ["trainer.length_penalty=-1"], "trainer.length_penalty=-1: must be a number >= 0"),
    ("a device peak of zero", ["trainer.peak_tflops=0"], "trainer.peak_tflops=0: must be a number > 0"),
    ("a card of no memory to train as on", ["trainer.gpu_gb=0"], "trainer.gpu_gb=0: must be a number > 0, or null"),
    ("a card to train as on, on the CPU", ["trainer.gpu_gb=12"],
     "trainer.gpu_gb=12: caps a GPU's memory, and this run trains on the cpu (trainer.device); leave it null there"),
    ("an attention kernel that does not exist", ["trainer.attention=[flash,fast]"],
     "trainer.attention=[flash,fast]: unknown fast; expected a list of flash, efficient, cudnn, math"),
    ("attention kernels that cannot run the model's attention here", ["trainer.attention=flash"],
     "trainer.attention=[flash]: none of these kernels runs the model's masked (the encoder's and cross-attention) "
     "attention on cpu in float32 with attention dropout 0.1"),
    ("an fp32 product precision PyTorch does not have", ["trainer.matmul_precision=tf32"],
     "trainer.matmul_precision=tf32: expected highest (fp32 products in fp32), high (TF32 on a GPU of compute "
     "capability 8.0 or later) or medium (bf16 inside fp32 products)"),
    ("metrics logged every 0 steps", ["trainer.log_every=0"], "trainer.log_every=0: must be an integer >= 1"),
    ("decoding batches of 0 pairs", ["trainer.eval_batch_size=0"], "trainer.eval_batch_size=0: must be an integer >= 1"),
    ("a negative decoding length", ["trainer.max_len_a=-1"], "trainer.max_len_a=-1: must be a number >= 0"),
    ("no step checkpoints kept", ["trainer.keep_last=0"], "trainer.keep_last=0: must be an integer >= 1"),
    ("profiling from step 0, which is not a step", ["trainer.profile_from=0"],
     "trainer.profile_from=0: must be an integer >= 1, or null"),
    ("a negative learning rate", ["optim.lr=-1"], "optim.lr=-1: must be a number > 0, or null"),
    ("label smoothing of 1 or more", ["optim.label_smoothing=1.5"], "optim.label_smoothing=1.5: must be a number >= 0 and < 1"),
    ("a negative clipping norm", ["optim.clip_grad_norm=-1"], "optim.clip_grad_norm=-1: must be a number > 0, or null"),
    ("Adam with one beta", ["optim.betas=[0.9]"], "optim.betas=[0.9]: expected two numbers"),
    ("an encoder of no layers", ["model.encoder_layers=0"], "model.encoder_layers=0: must be an integer >= 1"),
    ("dropout of 1 or more", ["model.dropout=2"], "model.dropout=2: must be a number >= 0 and < 1"),
    ("averaging more checkpoints than are kept", ["trainer.average_last=5"],
     "trainer.average_last=5 needs as many step checkpoints kept: set trainer.keep_last=5 or more (it is 3)"),
    ("synthetic data in another language", ["data.src_lang=fr"], "data=synthetic translates between en and de; got fr->en"),
    ("a share of long sentences above 1", ["data.long_fraction=2"], "data.long_fraction must be in [0, 1], got 2"),
    ("Multi30k folder that does not exist", ["data=multi30k", "data.root=/nonexistent"],
     "data.root=/nonexistent: no such directory"),
    ("data=files without its paths", ["data=files", "data.src_lang=de", "data.tgt_lang=en"],  # all at once
     "data.train_prefix is required: add data.train_prefix=... to the command line\n"
     "data.valid_prefix is required: add data.valid_prefix=... to the command line\n"
     "data.test_prefix is required: add data.test_prefix=..."),
    ("a length limit above the positions the model takes", ["memory=truncate", "memory.max_src_len=2000"],
     "memory.max_src_len=2000: above model.max_positions=1024 less the special token; set at most 1023, or raise "
     "model.max_positions"),
    ("every pair longer than the limits, dropped", ["memory.max_src_len=1", "memory.max_tgt_len=1", "memory.overlong=drop"],
     "every training pair is longer than memory.max_src_len / max_tgt_len"),
    ("a corpus size of null", ["data.test_size=null"], "data.test_size=None: must be an integer >= 1"),
    ("a vocabulary threshold of null", ["tokenizer.min_freq=null"], "tokenizer.min_freq=None: must be an integer >= 1"),
    ("an empty Multi30k folder setting", ["data=multi30k", "data.root=''"],
     "data.root is empty (MULTI30K_ROOT set to nothing?): set it to the folder of the Multi30k raw files, or to "
     "null to download them"),
    ("a Multi30k folder named by digits alone, read as a number", ["data=multi30k", "data.root=2016"],
     "data.root=2016: expected a folder path; quote one made of digits: 'data.root=\"2016\"'"),
    ("a download address that is a folder", ["data=multi30k", "data.url=/data/multi30k"],
     "data.url=/data/multi30k: expected an http://, https:// or file:// address; a folder of the raw files is "
     "data.root"),
    ("an XLM-R tokenizer folder that does not exist", ["tokenizer=xlmr", "tokenizer.name_or_path=/nonexistent/xlmr"],
     "tokenizer.name_or_path=/nonexistent/xlmr: no such directory; give a directory written by save_pretrained, or a "
     "hub name"),
]
CHECKED_WITH_THE_SETTINGS = {"a corpus size of null", "a vocabulary threshold of null", "an empty Multi30k folder setting",
                             "a Multi30k folder named by digits alone, read as a number",
                             "a download address that is a folder", "an XLM-R tokenizer folder that does not exist",
                             "a seed of null", "a seed beyond PyTorch's range", "a fault injected at step 0"}  # before the data, as the trainer's are
FILES = [
    ("missing corpus file", {"train.de": None}, "{data}/train.de: file not found (nor train.de.gz)"),
    ("empty corpus file", {"train.de": ""}, "{data}/train.de: file is empty"),
    ("a corpus file beside its gzip-compressed copy", {"train.de.gz": gzip.compress(b"ein Satz\nzwei\n")},
     "{data}/train.de and train.de.gz are both there; remove or rename the one not to read"),
    ("parallel files of different lengths", {"train.de": "a\nb\nc\n"}, "{data}/train.de has 3 lines but"),
    ("parallel files of different lengths, by blank lines at the end", {"train.de": "a\nb\n\n\n"},
     "{data}/train.de has 4 lines but {data}/train.en has 2 (the last 2 line(s) of {data}/train.de are empty: blank "
     "lines at its end?); parallel files must have one sentence per line, line for line"),
    ("text that is not UTF-8", {"train.de": b"gut\n\xff\xfeschlecht\n"}, "{data}/train.de:2: invalid UTF-8 (byte 0xff)"),
    ("UTF-16 text of a script that fits one byte of each pair (no byte-order mark)",
     {"train.de": "Привет мир\nКак дела\n".encode("utf-16-le")},
     "{data}/train.de:1: a NUL byte, which text does not hold (UTF-16? binary?); convert the file to UTF-8 text"),
    ("UTF-16 text with a byte-order mark", {"train.de": "ein Satz\nzwei Sätze\n".encode("utf-16")},
     "{data}/train.de: looks like UTF-16, not UTF-8; convert the file to UTF-8"),
    ("a gzip-compressed file named without .gz", {"train.de": gzip.compress(b"ein Satz\nzwei\n")},
     "{data}/train.de: gzip-compressed data; name the file with .gz, or decompress it (gunzip)"),
    ("every line pair with an empty side", {"train.de": "eins\n\n", "train.en": "\ntwo\n"},
     "{data}/train.de, {data}/train.en: every line pair has an empty side"),
    ("old Mac line ends (a carriage return alone)", {"train.de": "ein Satz\rzwei Sätze\r"},
     "{data}/train.de:1: a carriage return inside the line (old Mac line endings?); convert the file to \\n line "
     "endings"),
    ("a folder where a corpus file should be", {"train.de": DIRECTORY},
     "{data}/train.de: is a directory; give the path prefix of text files"),
    ("a line longer than the model takes (after a line pair left out)",
     {"train.de": "ein Satz\n\n" + "Wort " * 1100 + "\n", "train.en": "a sentence\nlone\ntwo sentences\n"},
     "{data}/train.de:3: 1,101 source / 3 target positions (with the special token), above model.max_positions=1024; "
     "cut long sentences with memory=truncate (memory.overlong=drop leaves such pairs out), or raise "
     "model.max_positions (attention over N positions holds N x N scores per head)"),
    ("a target line longer than the model takes", {"train.en": "a sentence\n" + "word " * 1100 + "\n"},
     "{data}/train.en:2: 3 source / 1,101 target positions (with the special token), above model.max_positions=1024"),
    ("a held-out line longer than the model takes", {"test.de": "ein Satz\n" + "Wort " * 1100 + "\n"},
     "{data}/test.de:2: 1,101 source / 3 target positions (with the special token), above model.max_positions=1024; "
     "remove or split that line, or raise model.max_positions"),
    ("bad files in several splits", {"train.en": None, "valid.de": "", "test.en": "a\n"},  # all, a line each
     "{data}/train.en: file not found (nor train.en.gz)\n{data}/valid.de: file is empty\n{data}/test.de has 2 lines but"),
]


def data_dir(tmp_path: Path, files: dict) -> Path:
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "valid", "test"):
        (data / f"{split}.de").write_text("ein Satz\nzwei Sätze\n")
        (data / f"{split}.en").write_text("a sentence\ntwo sentences\n")
    for name, content in files.items():
        (data / name).unlink(missing_ok=True)
        if content is DIRECTORY:
            (data / name).mkdir()
        elif isinstance(content, bytes):
            (data / name).write_bytes(content)
        elif content is not None:
            (data / name).write_text(content)
    return data


def files_overrides(data: Path) -> list[str]:
    return ["data=files", "data.src_lang=de", "data.tgt_lang=en",
            *(f"data.{s}_prefix={data / s}" for s in ("train", "valid", "test"))]


@pytest.mark.parametrize("what,overrides,message", COMMAND_LINE, ids=[c[0] for c in COMMAND_LINE])
def test_command_line_mistakes(what, overrides, message):
    with pytest.raises(UserError) as e:
        check_command_line(overrides)
    assert str(e.value).startswith(message) and str(e.value).count("\n") == message.count("\n")
    # and the docs show the whole lines (the list of a group's options, say), not only their start
    row = next(r for r in DOC.read_text().splitlines() if r.startswith(f"| {what} |"))
    assert row.endswith(f" | {doc_cell(str(e.value))} |"), row


def doc_cell(message: str) -> str:
    """A message as docs/bad_input.md shows it: each of its lines as code, one under the other."""
    return "<br>".join(f"`{line}`" for line in message.replace("|", "\\|").splitlines())


# the trainer's, model's and optimizer's settings and the batch size: found before the corpus is read and tokenized
EARLY = {c[0] for c in RUN if all(o.split(".")[0] in ("trainer", "model", "optim") or o.startswith("data.batch_size")
                                  for o in c[1]) and "training data" not in c[2]} | CHECKED_WITH_THE_SETTINGS


@pytest.mark.parametrize("what,overrides,message", RUN, ids=[c[0] for c in RUN])
def test_settings_caught_before_training(what, overrides, message, tmp_path, shared_cache):
    overrides = [o.replace("{readme}", str(README)) for o in overrides]
    message = message.replace("{readme}", str(README))
    base = FAST_TRAIN if any(o.startswith("data=") for o in overrides) else FAST  # other corpora, other keys
    check_command_line([*base, *overrides])  # these pass the command-line check; the run catches them
    cache = tmp_path / "cache" if what in EARLY else shared_cache  # an empty one where nothing may be written
    cfg = compose_config(*base, *overrides, run_dir=tmp_path / "run", cache_dir=cache)
    with pytest.raises(UserError) as e:
        train(cfg)
    assert str(e.value).startswith(message) and str(e.value).count("\n") == message.count("\n")
    run = Path(cfg.paths.output_dir)
    assert '"status": "failed"' in (run / "summary.json").read_text()
    metrics = run / "metrics.jsonl"
    assert not metrics.exists() or '"loss"' not in metrics.read_text()  # stopped before the first step
    if what in EARLY:
        assert not cache.exists() and not (run / "tokenizer").exists()  # and before the data


@pytest.mark.skipif(importlib.util.find_spec("MeCab") is not None, reason="sacrebleu[ja] is installed here")
def test_a_target_language_whose_bleu_tokenizer_is_missing_stops_before_the_data(tmp_path):
    """Japanese BLEU needs sacrebleu[ja] (MeCab): said at once, not at the first validation hours later; the
    corpus files named here do not exist, so the check comes before they are read."""
    missing = tmp_path / "nowhere"
    cfg = compose_config("data=files", "data.src_lang=de", "data.tgt_lang=ja", *FAST_TRAIN,
                         *(f"data.{s}_prefix={missing / s}" for s in ("train", "valid", "test")),
                         run_dir=tmp_path / "run", cache_dir=tmp_path / "cache")
    with pytest.raises(UserError) as e:
        train(cfg)
    row = next(r for r in DOC.read_text().splitlines() if r.startswith("| a target language whose BLEU"))
    assert str(e.value).startswith("data.tgt_lang=ja: BLEU needs its tokenizer") and str(e.value) in row
    assert "\n" not in str(e.value) and not (tmp_path / "cache").exists()


@pytest.mark.parametrize("what,files,message", FILES, ids=[c[0] for c in FILES])
def test_bad_corpus_files(what, files, message, tmp_path):
    data = data_dir(tmp_path, files)
    cfg = compose_config(*files_overrides(data), *FAST_TRAIN, run_dir=tmp_path / "run", cache_dir=tmp_path / "cache")
    with pytest.raises(UserError) as e:
        train(cfg)
    assert str(e.value).startswith(message.format(data=data)), str(e.value)
    assert str(e.value).count("\n") == message.count("\n")


def test_held_out_lines_past_trainer_limit_eval_are_not_measured(tmp_path, shared_cache):
    """Only the held-out pairs evaluated (trainer.limit_eval) are held to model.max_positions; a negative seed
    (torch.manual_seed takes it) and more threads than plan.py's machine has (it plans for another) pass."""
    import plan

    data = data_dir(tmp_path, {"test.de": "ein Satz\n" + "Wort " * 1100 + "\n"})
    cfg = compose_config(*files_overrides(data), *FAST_TRAIN, "trainer.limit_eval=1", "seed=-1",
                         "tokenizer.min_freq=1", run_dir=tmp_path / "run", cache_dir=shared_cache)
    assert train(cfg)["status"] == "completed"
    assert plan.main(["trainer.threads=100000", "plan.src_len=9", "plan.tgt_len=9", "plan.src_vocab=50",
                      "plan.tgt_vocab=50"]) == 0


def test_a_run_directory_that_is_a_file(monkeypatch):
    """Hydra's FileExistsError traceback, before: a run or sweep directory naming a file, or under one."""
    monkeypatch.chdir(ROOT)
    check_command_line(["hydra.sweep.dir=README.md"])  # a single run has no sweep directory
    check_command_line(["-m", "hydra.run.dir=README.md", "seed=1,2"])  # nor a sweep a run directory
    for overrides in (["hydra.run.dir=README.md"], ["-m", "hydra.sweep.dir=README.md/sweep"]):
        with pytest.raises(UserError) as e:
            check_command_line(overrides)
        row = next(r for r in DOC.read_text().splitlines() if r.startswith("| a run directory that is a file |"))
        assert doc_cell(str(e.value)) in row
    assert str(e.value) == "hydra.sweep.dir=README.md/sweep: lies under README.md, a file; name a directory"


def test_a_run_directory_that_cannot_be_written(monkeypatch, tmp_path):
    """Hydra's PermissionError traceback, from its mkdir: a folder of another user, a read-only mount (/sys, where
    os.access says yes). Found by making a folder there (and removing it), faked here: this test may run as root."""
    import tempfile

    monkeypatch.chdir(ROOT)

    def refused(**kwargs):
        raise PermissionError(1, "Operation not permitted")

    check_command_line([f"hydra.run.dir={tmp_path / 'run'}"])
    assert list(tmp_path.iterdir()) == []  # the check's folder is removed
    monkeypatch.setattr(tempfile, "mkdtemp", refused)
    with pytest.raises(UserError) as e:
        check_command_line([f"hydra.run.dir={tmp_path / 'run'}"])
    assert str(e.value) == (f"hydra.run.dir={tmp_path / 'run'}: lies under {tmp_path}, where this process cannot "
                            "write (Operation not permitted); name a directory it can")
    row = next(r for r in DOC.read_text().splitlines() if r.startswith("| a run directory that cannot be written |"))
    assert "this process cannot write (Operation not permitted); name a directory it can" in row


def test_a_gpu_index_beyond_those_visible(monkeypatch):
    from src.settings import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(UserError, match=r"^trainer.device=cuda:2: 2 CUDA device\(s\) visible, numbered from 0$"):
        resolve_device("cuda:2")
    with pytest.raises(UserError, match=r"^trainer.device=cuda:x: expected auto, cpu, cuda or cuda:<index>$"):
        resolve_device("cuda:x")
    # torchrun's ranks take a GPU each, by LOCAL_RANK: a rank past the GPUs failed in set_device with a traceback
    assert World(rank=1, size=2, local_rank=1).device(torch.device("cuda")) == torch.device("cuda", 1)
    with pytest.raises(UserError) as e:
        World(rank=2, size=3, local_rank=2).device(torch.device("cuda"))
    assert str(e.value) == ("torchrun started more processes on this machine than it has GPUs (2 visible; this is "
                            "LOCAL_RANK 2): --nproc_per_node=2")
    assert doc_cell(str(e.value)) in DOC.read_text()


def test_bom_and_crlf_are_read_as_plain_text(tmp_path, caplog):
    """A run on a file with a byte-order mark and CRLF line ends learns the vocabulary of the same text without
    them: no word glued to U+FEFF, no carriage return read as a space (with a warning)."""
    import logging

    from src.tokenizers import load_codecs

    vocabularies = []
    for name, text in (("plain", b"ein Satz\nzwei S\xc3\xa4tze\n"), ("bom_crlf", b"\xef\xbb\xbfein Satz\r\nzwei S\xc3\xa4tze\r\n")):
        (tmp_path / name).mkdir()
        data = data_dir(tmp_path / name, {"train.de": text})
        cfg = compose_config(*files_overrides(data), *FAST_TRAIN, "trainer.max_steps=1", "trainer.eval_every=1",
                             "tokenizer.min_freq=1", run_dir=tmp_path / name / "run", cache_dir=tmp_path / "cache")
        with caplog.at_level(logging.WARNING):
            assert train(cfg)["status"] == "completed"
        vocabularies.append(load_codecs(tmp_path / name / "run" / "tokenizer")[0].itos)
    assert "ein" in vocabularies[0] and vocabularies[1] == vocabularies[0]
    assert "carriage return" not in caplog.text.lower() and "\r" not in caplog.text


@pytest.mark.slow
def test_a_test_file_with_an_empty_line_is_translated_and_scored_whole(tmp_path, capsys):
    """data=files: the run's test BLEU covers every line of the test files, an empty or blank source line included
    (its pair was skipped): the run writes and scores the translations translate.py --reference writes and scores,
    an empty one for the blank sources (the run decoded them into words)."""
    import json

    import translate

    data = data_dir(tmp_path, {"test.de": "ein Satz\n\nzwei Sätze\n  \n",
                               "test.en": "a sentence\nnothing\ntwo sentences\nnone\n"})
    # trained until it translates the training sentences: a blank source would then be decoded into words
    cfg = compose_config(*files_overrides(data), *FAST_TRAIN, "trainer.max_steps=40", "trainer.eval_every=40",
                         "optim.warmup_steps=5", "tokenizer.min_freq=1", run_dir=tmp_path / "run",
                         cache_dir=tmp_path / "cache")
    summary = train(cfg)
    assert summary["status"] == "completed"
    hyps = (tmp_path / "run" / "test.hyp.txt").read_text().split("\n")
    assert len(hyps) == 5 and hyps[1] == hyps[3] == hyps[4] == "" and hyps[0] and hyps[2]
    out = tmp_path / "again.txt"
    capsys.readouterr()
    assert translate.main([str(tmp_path / "run" / "checkpoints" / "best.pt"), "--input", str(data / "test.de"),
                           "--reference", str(data / "test.en"), "--output", str(out), "--device", "cpu"]) == 0
    assert out.read_text() == (tmp_path / "run" / "test.hyp.txt").read_text()
    assert json.loads(capsys.readouterr().out)["bleu"] == summary["test_bleu"]


def test_bf16_on_a_gpu_without_it_says_to_use_fp16(monkeypatch):
    from src.errors import ConfigError
    from src.memory import MemoryStrategy

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla K80")
    with pytest.raises(ConfigError, match=r"^memory.amp=bf16: Tesla K80 has no bf16; use memory.amp=fp16$"):
        MemoryStrategy(amp="bf16").check_device(torch.device("cuda"))


@pytest.mark.parametrize("card,capability,warns", [("Tesla V100-SXM2-16GB", (7, 0), True),
                                                   ("Tesla T4", (7, 5), True),
                                                   ("NVIDIA A100-SXM4-80GB", (8, 0), False),
                                                   ("NVIDIA GeForce RTX 3060", (8, 6), False)])
def test_bf16_on_a_gpu_before_ampere_warns_that_fp16_is_its_half_precision(caplog, monkeypatch, card, capability,
                                                                            warns):
    """PyTorch answers torch.cuda.is_bf16_supported() with True on a V100 or a T4, where it emulates bf16: memory=amp
    (bf16) trained there in silence, saving the memory and not the time (it was refused in a test that mocked False,
    which such cards never answer)."""
    import logging

    from src.memory import MemoryStrategy

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: card)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: capability)
    with caplog.at_level(logging.WARNING):
        MemoryStrategy(amp="bf16").check_device(torch.device("cuda"))
        MemoryStrategy(amp="fp16").check_device(torch.device("cuda"))
    expected = (f"memory.amp=bf16 on {card} (compute capability {capability[0]}.{capability[1]}): PyTorch emulates "
                "bf16 on GPUs before compute capability 8.0, which saves the memory but not the time; memory.amp=fp16 "
                "is this card's half precision (with a GradScaler)")
    assert [r.getMessage() for r in caplog.records] == ([expected] if warns else [])


def test_fp16_on_the_cpu_warns_to_use_bf16(caplog):
    import logging

    from src.memory import MemoryStrategy

    with caplog.at_level(logging.WARNING):
        MemoryStrategy(amp="fp16").check_device(torch.device("cpu"))
    assert any(r.message.startswith("memory.amp=fp16 on the CPU: it runs, but CPUs multiply fp16 slowly")
               for r in caplog.records)


@pytest.mark.parametrize("onednn_bf16", [False, True])
def test_bf16_on_a_cpu_without_avx512_warns_that_it_is_slow_there(caplog, monkeypatch, onednn_bf16):
    import logging

    from src.memory import MemoryStrategy

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: onednn_bf16)
    with caplog.at_level(logging.WARNING):
        MemoryStrategy(amp="bf16").check_device(torch.device("cpu"))
    warned = [r for r in caplog.records if r.message.startswith("memory.amp=bf16 on a CPU without AVX-512: it runs")]
    assert len(warned) == (0 if onednn_bf16 else 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown where no GPU exists")
def test_a_gpu_where_there_is_none(fast_cfg):
    with pytest.raises(UserError, match=r"^trainer.device=cuda: no CUDA device is visible; use trainer.device=cpu"):
        train(fast_cfg("trainer.device=cuda"))


@pytest.mark.slow
def test_train_py_shows_a_line_for_each_problem_and_no_traceback(tmp_path):
    proc = run_cli("train.py", "model.dmodel=5", "seed=abc")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "error: model.dmodel: no such key; did you mean model.d_model?",
        "error: seed=abc: expected an integer (the default is 1234)"]
    assert "Traceback" not in proc.stdout + proc.stderr
    # an unset environment variable in an override: Hydra's job record resolved it first, a traceback
    proc = run_cli("train.py", "trainer.max_steps=${oc.env:MT_NOT_SET}", "hydra.run.dir=" + str(tmp_path / "run"))
    assert proc.returncode == 1 and "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-2000:]
    assert ("error: trainer.max_steps: KeyError raised while resolving interpolation: \"Environment variable "
            "'MT_NOT_SET' not found\"") in proc.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["overrides"] == ["trainer.max_steps=${oc.env:MT_NOT_SET}"]  # as typed
    # the logger's own setting, said once (not again as "the failure is in summary.json only: no logger")
    proc = run_cli("train.py", "logger=wandb", "logger.wandb.mode=onlne", "hydra.run.dir=" + str(tmp_path / "typo"))
    assert proc.returncode == 1 and (proc.stdout + proc.stderr).count("onlne") == 1, proc.stdout + proc.stderr
    # Hydra's disabled job logging turns the run's loggers off: the error printed nothing
    proc = run_cli("train.py", "hydra/job_logging=disabled", "ckpt_path=/nowhere/best.pt",
                   "hydra.run.dir=" + str(tmp_path / "quiet"))
    assert proc.returncode == 1 and proc.stderr.startswith("error: ckpt_path=/nowhere/best.pt"), proc.stderr[-2000:]


@pytest.mark.parametrize("args,status", [
    (["train.py", "trainer.max_stepz=3", "memory=nosuch"], 1), (["train.py", "--help"], 0),
    (["train.py", "--cfg", "job"], 0), (["plan.py", "--help"], 0), (["plan.py", "model=nosuch"], 1),
    (["translate.py", "--help"], 0), (["translate.py", "best.pt", "--beam-size", "0"], 2)])
def test_the_commands_answer_before_importing_torch(args, status):
    """A mistyped override or flag, --help and --cfg are answered without torch and the run's modules (1.5 of 2 s)."""
    proc = run_cli("-X", "importtime", *args)
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "torch" not in imported and "src.run" not in imported and "src.planner" not in imported
    assert "hydra" in imported or args[0] == "translate.py"
    assert proc.returncode == status, proc.stderr[-2000:]


def test_the_docs_table_lists_every_case_tried():
    rows = [line for line in DOC.read_text().splitlines() if line.startswith("| ") and not line.startswith("| input")]
    documented = {row.split(" | ")[0].removeprefix("| ").strip() for row in rows}
    tried = {c[0] for c in COMMAND_LINE + RUN + FILES} | {"BOM or CRLF line ends", "bf16 on a GPU without bf16",
                                                           "bf16 on a GPU before Ampere",
                                                           "fp16 on the CPU", "bf16 on a CPU without AVX-512",
                                                           "a GPU where there is none",
                                                           "a run directory that is a file",
                                                           "a run directory that cannot be written",
                                                           "more torchrun processes than GPUs",
                                                           # test_slurm.py
                                                           "a sweep's job whose GPUs are not one per task",
                                                           "a local sweep's job given more cores than the machine lets it use",
                                                           # test_tokenizers.py
                                                           "an XLM-R hub name not in Hugging Face's cache, without network",
                                                           # test_sweeps.py
                                                           "W&B online where its server cannot be reached",
                                                           "a SLURM job of several tasks started without submitit or torchrun",
                                                           # test_config.py, test_sweeps.py: conf files of one's own
                                                           "an unknown key in an option file of one's own",
                                                           "a preset of one's own without its package line",
                                                           "a config file of one's own that is not YAML",
                                                           "a config file of one's own that is not UTF-8",
                                                           "a logger option with no logger behind it",
                                                           "a run directory another process is running in",  # test_resume.py
                                                           "resuming another model's checkpoint",  # test_resume.py
                                                           # test_data.py (a race: the files change mid-run)
                                                           "training files rewritten while a run reads them",
                                                           "a target language whose BLEU tokenizer is not installed"}
    assert documented == tried
    assert len(tried) >= 12
    readme = (ROOT / "README.md").read_text()
    assert f"lists the {len(rows)} kinds tried" in " ".join(readme.split())
    text = DOC.read_text()
    for what, _, message in COMMAND_LINE + RUN + FILES:
        row = next(r for r in rows if r.startswith(f"| {what} |"))
        shown = doc_cell(message.replace("{data}", "data").replace("{readme}", "README.md"))[1:-1]  # the start of a last line, too
        assert shown in row, (what, shown)
    assert "Traceback" not in text


@pytest.mark.parametrize("args,message", [(["--batch-size", "0"], "--batch-size 0: must be >= 1"),
                                          (["--beam-size", "0"], "--beam-size 0: must be >= 1"),
                                          (["--length-penalty", "-1"], "--length-penalty -1.0: must be >= 0"),
                                          (["--max-len-b", "0"], "--max-len-b 0: must be >= 1")])
def test_translate_py_checks_its_arguments_before_loading_anything(args, message, capsys):
    import translate

    with pytest.raises(SystemExit) as e:
        translate.main(["/nonexistent.pt", "--input", "/nonexistent.de", *args])
    assert e.value.code == 2 and f"error: {message}" in capsys.readouterr().err


def test_translate_py_offers_the_autocast_and_precision_choices_training_has():
    import translate
    from src.kernels import MATMUL_PRECISIONS
    from src.memory import AMP_DTYPES

    choices = {a.dest: a.choices for a in translate.arguments()._actions if a.choices}
    assert choices == {"amp": ["none", *AMP_DTYPES], "matmul_precision": list(MATMUL_PRECISIONS)}


def test_tokenizers_that_end_sentences_with_other_ids_are_refused():
    """Batches end and pad the source with the target tokenizer's ids, and decoding with the source's own."""
    import types

    from src.building import build_model

    class Codec:
        def __init__(self, eos_id):
            self.pad_id, self.eos_id = 1, eos_id

        def __len__(self):
            return 50

    tiny = {"d_model": 16, "n_heads": 2, "d_ff": 32, "encoder_layers": 1, "decoder_layers": 1, "dropout": 0.0}
    assert build_model(tiny, types.SimpleNamespace(src_codec=Codec(2), tgt_codec=Codec(2))).args.src_vocab == 50
    with pytest.raises(UserError, match="must share the padding and end-of-sentence ids"):
        build_model(tiny, types.SimpleNamespace(src_codec=Codec(2), tgt_codec=Codec(3)))
