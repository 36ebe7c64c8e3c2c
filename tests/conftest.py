from __future__ import annotations

import gc
import io
import os
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

# pytest-xdist (pyproject.toml's addopts) runs a worker per core. Each worker's torch, and the runs it starts, take
# that worker's share of the cores: with PyTorch's default of a thread per core, 2 workers on 2 cores took as long
# as 1 (9 minutes, the threads of small kernels waiting on each other); with a thread each, 5. Set before torch is
# imported, which reads it then; the processes the tests start inherit it.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"

# Settings that make a run take seconds: a few hundred synthetic pairs, a handful of steps, no progress bar.
FAST_TRAIN = [
    "model=tiny",
    "data.batch_size=16",
    "trainer.max_steps=6",
    "trainer.eval_every=3",
    "trainer.log_every=2",
    "trainer.progress=false",
    "trainer.num_samples=0",
    "trainer.device=cpu",
]
FAST = ["data.train_size=300", "data.valid_size=20", "data.test_size=20", *FAST_TRAIN]


# The test files, longest first: pytest-xdist (--dist loadfile --no-loadscope-reorder, pyproject.toml) gives each
# worker the next file in this order as it finishes one, so that the long files do not come last to one worker
# while the other has nothing left. With xdist's own order (by the number of tests) test_distributed.py came last,
# and one worker finished 86 s after the other (505 s against 419, 2026-12-05). Seconds of each file in one run on 2
# cores (2026-12-07 at 0707809, `--durations=0`: 1,137 s over the two workers, 9 min 41 s; test_distributed.py's
# 4-rank test about 20 s shorter since). A file not listed runs after these; the order only changes how long the
# suite takes.
LONGEST_FIRST = ["test_distributed.py",  # 286 s
                 "test_planner.py",  # 217
                 "test_resume.py",  # 152
                 "test_sweeps.py",  # 107
                 "test_train_e2e.py",  # 101
                 "test_bad_input.py",  # 74
                 "test_config.py",  # 41
                 "test_memory.py",  # 41
                 "test_data.py",  # 27
                 "test_slurm.py",  # 22
                 "test_tokenizers.py",  # 19
                 "test_trainer.py"]  # 19 (25 in another run: torch.compile); the rest, 14 s or less each


def pytest_collection_modifyitems(items: list) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its own order


@pytest.fixture(autouse=True)
def _steps_planned_anew():
    """Each test plans its own steps: src/planner.py keeps those a process planned (a sweep plans them again), and
    one test's plan, or its patches, must not answer another's."""
    yield
    if planner := sys.modules.get("src.planner"):
        planner.forget_estimates()
    _objects_kept_out_of_collections()


def pytest_collection_finish(session) -> None:
    _spacy_ready_for_forked_children()
    _objects_kept_out_of_collections()


def _spacy_ready_for_forked_children() -> None:
    """A run tokenizes with spaCy in forked child processes, one per side (src/data/encode.py: the run's own
    process stays free of spaCy). Forked from a test worker that had not imported spaCy, each child imported it
    (1.1 s) and built its language's tokenizer from cold (0.2 s; 0.07-0.15 s where the parent had built one): 62 s
    of samples in the children in one run of the suite (py-spy, 2026-12-07). Imported here once per worker, with the
    synthetic data's tokenizers built once, spaCy is in every child the worker forks; the children still tokenize
    as a run's do."""
    import spacy

    for lang in ("de", "en"):
        spacy.blank(lang)


def _objects_kept_out_of_collections() -> None:
    """Each run begins with a full collection of Python's cycle collector (src/memory.py's free_earlier_runs, for
    a sweep's jobs in one process). In a test worker, which holds torch, Hydra, W&B and the tests' modules, one
    takes 0.3 s or more: 119 s of the two workers' 1,103 s in one run of the suite (py-spy, 2026-12-07). What is
    alive between tests (the modules, the fixtures kept) is moved out of the collector's sight once the garbage is
    collected (gc.freeze); each run's collection then looks at what was made since. The objects of a test's own
    runs are made after it, and collected as in a sweep."""
    gc.collect()
    gc.freeze()


# The slow marker: a test that takes about 3 s or more on 2 cores (setup and call, in the suite's own run) is marked
# @pytest.mark.slow, so that `-m "not slow"` is the quick run. The summary lists the unmarked tests that took more
# than UNMARKED_SLOW_S (above 3 s, for the hour's speed), to be marked or made faster.
UNMARKED_SLOW_S = 5.0
_unmarked_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report) -> None:  # in the controller too: xdist passes each worker's reports on
    if report.when in ("setup", "call") and "slow" not in report.keywords:
        _unmarked_seconds[report.nodeid] = _unmarked_seconds.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return  # the controller sums the workers' reports
    over = sorted(((s, n) for n, s in _unmarked_seconds.items() if s > UNMARKED_SLOW_S), reverse=True)
    if over:
        terminalreporter.section(f"tests over {UNMARKED_SLOW_S:g} s not marked slow (@pytest.mark.slow; the rule: tests/conftest.py)")
        for seconds, nodeid in over:
            terminalreporter.write_line(f"{seconds:6.1f} s  {nodeid}")


def compose_config(*overrides: str, run_dir: Path | None = None, cache_dir: Path | None = None):
    """The config ``train.py`` would run with these overrides (Hydra's compose API; no Hydra run dir)."""
    extra = []
    if run_dir is not None:
        extra.append(f"paths.output_dir={run_dir}")
    if cache_dir is not None:
        extra.append(f"paths.cache_dir={cache_dir}")
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="train", overrides=[*overrides, *extra])


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory) -> Path:
    """paths.cache_dir for the tests' runs, shared as runs share it: the encoded corpora are keyed by their text,
    the tokenizer settings and the encoding code (tests/test_data.py checks that), so a test that does not test the
    cache itself does not tokenize again what an earlier test has tokenized. Tests of the cache use their own.
    ``MT_TEST_CACHE`` names a cache made beforehand: the lent GPU machine has no spaCy to make one
    (experiments/throughput/prepare_device.sh)."""
    if os.environ.get("MT_TEST_CACHE"):
        return Path(os.environ["MT_TEST_CACHE"])
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def fast_cfg(tmp_path, shared_cache):
    def make(*overrides: str):
        return compose_config(*FAST, *overrides, run_dir=tmp_path / "run", cache_dir=shared_cache)

    return make


@pytest.fixture(scope="session")
def xlmr_dir(tmp_path_factory) -> Path:
    """A small tokenizer of XLM-R's class (sentencepiece unigram, XLM-R's special pieces and order), trained
    here on synthetic text and saved with save_pretrained: what `tokenizer=xlmr` loads from the hub."""
    return make_xlmr_tokenizer(tmp_path_factory.mktemp("xlmr"))


def make_xlmr_tokenizer(out: Path, vocab_size: int = 500, seed: int = 7) -> Path:
    """An XLM-R-class tokenizer (XLM-R's special pieces and ids) of a unigram model trained on synthetic text."""
    import sentencepiece as spm
    from transformers import XLMRobertaTokenizer

    from src.data.synthetic import LengthDistribution, generate_corpus

    pairs = generate_corpus({"train": 3000}, seed=seed, lengths=LengthDistribution())["train"]
    text = [s for pair in pairs for s in pair]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text), model_writer=model, vocab_size=vocab_size, model_type="unigram",
        character_coverage=1.0, bos_id=-1, eos_id=-1, unk_id=0, minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    pieces = [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]
    vocab = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    vocab += [p for p in pieces if p[0] not in ("<unk>", "<s>", "</s>")] + [("<mask>", 0.0)]
    XLMRobertaTokenizer(vocab=vocab).save_pretrained(out)
    return out


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    """Tests never reach the network: W&B offline, Hugging Face hub off. W&B does not list the installed packages
    for each run (its requirements file: a quarter of a second, in each of the tests' runs that log to W&B)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB__SAVE_REQUIREMENTS", "false")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("MT_CACHE_DIR", raising=False)


def multi30k_root() -> Path | None:
    root = os.environ.get("MULTI30K_ROOT")
    return Path(root) if root else None
