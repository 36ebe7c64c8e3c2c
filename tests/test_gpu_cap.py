"""trainer.gpu_gb: a run capped at what a smaller card leaves beside its CUDA context. On the CPU the allocator's cap
is checked against a made-up card; on a GPU against the allocator itself."""

import json
import types

import pytest
import torch
from omegaconf import OmegaConf

from src.errors import ConfigError
from src.gpu_cap import GiB, cap_fraction, gpu_memory_cap
from src.memory import memory_strategy
from src.run import train

from .conftest import FAST, compose_config


def needs_cuda(test):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(test))


def made_up_card(monkeypatch, total_gb: float) -> list[tuple]:
    """A card of ``total_gb`` GB for gpu_memory_cap to ask about; the fractions set on it, in order."""
    calls = []
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(total_memory=int(total_gb * GiB), name="Made-up GPU"))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device: calls.append((f, device)))
    return calls


def test_an_80_gb_card_capped_at_12_leaves_the_allocator_11_5_gb_for_the_run_alone(monkeypatch):
    calls = made_up_card(monkeypatch, 80)
    device = torch.device("cuda", 1)
    with gpu_memory_cap(12, 0.5, device):
        assert calls == [(11.5 / 80, device)]
    assert calls[-1] == (1.0, device)  # the next job of a sweep has the whole card
    with pytest.raises(RuntimeError, match="in the run"), gpu_memory_cap(12, 0.5, device):
        raise RuntimeError("in the run")
    assert calls[-2:] == [(11.5 / 80, device), (1.0, device)]
    calls.clear()
    with gpu_memory_cap(None, 0.5, device):  # no cap: the allocator left as it is
        pass
    assert calls == []


def test_a_card_no_smaller_than_the_gpu_or_its_context_is_refused_in_one_line():
    assert cap_fraction(12, 0.5, 24 * GiB) == pytest.approx(11.5 / 24)
    with pytest.raises(ConfigError, match=r"^trainer.gpu_gb=80: Made-up GPU has 80.0 GB, not more; a cap emulates a "
                                          r"smaller card \(null: the whole card\)$"):
        cap_fraction(80, 0.5, 80 * GiB, "Made-up GPU")
    with pytest.raises(ConfigError, match=r"^trainer.gpu_gb=0.5: not more than the 0.5 GB of the CUDA context "
                                          r"\(plan.context_gb\)"):
        cap_fraction(0.5, 0.5, 80 * GiB)


def test_a_run_on_the_cpu_refuses_a_card_to_train_as_on_before_the_data_is_read(tmp_path, monkeypatch):
    monkeypatch.setattr("src.run.prepare_data", lambda *a, **k: pytest.fail("the data was read"))
    with pytest.raises(ConfigError, match=r"^trainer.gpu_gb=12: caps a GPU's memory, and this run trains on the cpu"):
        train(compose_config(*FAST, "trainer.gpu_gb=12", run_dir=tmp_path))
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "failed"


def test_memory_auto_plans_for_the_card_the_run_is_capped_at_unless_given_a_budget():
    def budget(*overrides: str) -> float | None:
        memory = OmegaConf.to_container(compose_config("memory=auto", *overrides).memory, resolve=True)
        return memory_strategy(memory).budget_gb

    assert budget("trainer.gpu_gb=12") == 12 and budget("trainer.gpu_gb=12", "memory.budget_gb=8") == 8
    with pytest.raises(ConfigError, match=r"^memory.budget_gb=None: memory=auto needs the memory budget in GB"):
        budget()


@pytest.mark.slow
def test_plan_py_checks_the_card_the_run_trains_as_on(capsys):
    import plan

    tiny = ["model=tiny", "plan.src_len=200", "plan.tgt_len=200", "plan.src_vocab=1000", "plan.tgt_vocab=1000"]
    assert plan.main([*tiny, "trainer.gpu_gb=0.6"]) == 0
    assert "does NOT fit a 0.6 GB card (trainer.gpu_gb)" in capsys.readouterr().out
    assert plan.main([*tiny, "trainer.gpu_gb=2", "plan.gpu_gb=0.6"]) == 0
    assert "fits a 2 GB card (trainer.gpu_gb)" in capsys.readouterr().out


@needs_cuda
def test_the_allocator_refuses_past_the_cap_and_holds_the_whole_card_again_after_it():
    device = torch.device("cuda")
    torch.cuda.empty_cache()
    with gpu_memory_cap(1.5, 0.5, device):  # 1 GiB for the allocator
        small = torch.empty(GiB // 2, dtype=torch.uint8, device=device)
        with pytest.raises(torch.OutOfMemoryError, match="allowed"):
            torch.empty(GiB, dtype=torch.uint8, device=device)
        del small
    large = torch.empty(2 * GiB, dtype=torch.uint8, device=device)
    del large
    torch.cuda.empty_cache()


@needs_cuda
def test_a_capped_run_trains_within_the_cap_and_says_so(tmp_path, shared_cache):
    summary = train(compose_config(*FAST, "trainer.device=cuda", "trainer.gpu_gb=2", run_dir=tmp_path,
                                   cache_dir=shared_cache))
    assert summary["status"] == "completed" and summary["gpu_gb"] == 2
    assert summary["peak_reserved_mb"] <= 1.5 * 1024


@needs_cuda
def test_a_run_capped_below_its_step_backs_off_to_two_micro_batches_that_fit(tmp_path, shared_cache):
    """The cap between what a step of 256 pairs allocates in one micro-batch (so it cannot fit) and what it reserves
    in two (so they fit), each measured uncapped first: capped, the run runs out of memory in its first step, as a
    card of that size would, redoes it with two micro-batches and trains within the cap."""
    common = [*FAST, "trainer.device=cuda", "data.batch_size=256", "trainer.max_steps=2", "trainer.eval_every=2"]

    def run(name: str, *extra: str) -> dict:
        summary = train(compose_config(*common, *extra, run_dir=tmp_path / name, cache_dir=shared_cache))
        assert summary["status"] == "completed", summary.get("error")
        return summary

    allocated = run("one")["peak_memory_mb"]  # CUDA's max_memory_allocated: no cap below it holds the step
    reserved = run("two", "memory=accum", "memory.accum_steps=2")["peak_reserved_mb"]
    assert reserved < 0.9 * allocated, (allocated, reserved)  # room between them for the cap
    allowed_mb = (allocated + reserved) / 2
    capped = run("capped", f"trainer.gpu_gb={0.5 + allowed_mb / 1024:.4f}")
    assert [b["step"] for b in capped["oom_backoffs"]] == [1] and capped["final_accum_steps"] == 2
    assert capped["peak_reserved_mb"] <= allowed_mb
