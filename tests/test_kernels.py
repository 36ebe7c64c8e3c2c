"""trainer.attention (src/kernels.py): the kernels attention runs, checked at the start, and planned."""

import dataclasses
import itertools
import os

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from src.errors import ConfigError
from src.kernels import attention_backends, attention_names, check_attention, cuda_kernel
from src.memory import MemoryStrategy
from src.model import ModelArgs, Transformer
from src.planner import TINY, StepShape, estimate_step, measure_step

KERNEL_OPS = {"_scaled_dot_product_flash_attention_for_cpu": "flash", "_scaled_dot_product_flash_attention": "flash",
              "_scaled_dot_product_efficient_attention": "efficient", "_scaled_dot_product_cudnn_attention": "cudnn"}


class KernelsSeen(TorchDispatchMode):
    """The fused attention kernels that ran (by ATen operator); math shows as none of them."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.removeprefix("aten::")
        if name in KERNEL_OPS:
            self.seen.append(KERNEL_OPS[name])
        return func(*args, **(kwargs or {}))


def model(attention_dropout: float, device: str = "cpu") -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelArgs(src_vocab=40, tgt_vocab=40, pad_id=1, attention_dropout=attention_dropout,
                                 **TINY)).to(device)


def step_grads(net: Transformer, value, device: str = "cpu") -> tuple[list[str], list[torch.Tensor]]:
    """One forward and backward pass of a padded batch under trainer.attention=``value``: the kernels seen and the
    gradients."""
    g = torch.Generator().manual_seed(1)
    src, tgt = (torch.randint(4, 40, (3, n), generator=g).to(device) for n in (7, 6))
    src[0, 4:] = 1  # padding: the masked calls need a mask
    net.zero_grad()
    torch.manual_seed(2)  # the same dropout masks (outside attention) in each call
    with attention_backends(value), KernelsSeen() as mode:
        net(src, tgt).float().square().mean().backward()
    return mode.seen, [p.grad.clone() for p in net.parameters()]


@pytest.mark.parametrize("value, why", [("bogus", "unknown bogus"), ([], "empty"), (["math", "math"], "named twice"),
                                        (["flash", 3], "unknown 3"), (3, "unknown 3"), (True, "unknown True"),
                                        ([["flash"]], r"unknown \['flash'\]")])
def test_a_setting_that_names_no_kernel_list_is_refused_by_key(value, why):
    with pytest.raises(ConfigError, match=rf"^trainer\.attention=.*{why}.*flash, efficient, cudnn, math"):
        attention_names(value)


def test_one_name_is_a_list_of_one_and_null_is_pytorchs_choice():
    assert attention_names("math") == ["math"] and attention_names(["flash", "math"]) == ["flash", "math"]
    assert attention_names(None) is None


def test_the_chosen_kernels_run_and_compute_what_the_others_do():
    """Without attention dropout the CPU has two kernels: PyTorch's choice is flash, [math] runs no fused kernel,
    and both give the same gradients; the setting is the run's only (restored after it)."""
    net = model(attention_dropout=0.0)
    chosen, reference = step_grads(net, None)
    math, grads = step_grads(net, ["math"])
    assert chosen and set(chosen) == {"flash"} and math == []
    for a, b in zip(reference, grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert step_grads(net, None)[0] == chosen  # restored


def test_kernels_that_cannot_run_the_models_attention_are_refused_at_the_start():
    """The CPU's flash kernel runs no dropout: with attention dropout, [flash] alone fails the check (named), and
    [flash,math] passes it (math attends where flash cannot)."""
    cpu = torch.device("cpu")
    with_dropout = ModelArgs(src_vocab=8, tgt_vocab=8, pad_id=1, attention_dropout=0.1, **TINY)
    for value in (["flash"], ["efficient", "cudnn"]):
        with attention_backends(value), pytest.raises(ConfigError, match=r"^trainer\.attention=\[.*masked .* on cpu in "
                                                                         r"float32 with attention dropout 0\.1"):
            check_attention(value, with_dropout, cpu, torch.float32)
    with attention_backends(["flash", "math"]):
        check_attention(["flash", "math"], with_dropout, cpu, torch.float32)
    without = dataclasses.replace(with_dropout, attention_dropout=0.0)
    with attention_backends(["flash"]):
        check_attention(["flash"], without, cpu, torch.bfloat16)


@pytest.mark.slow
def test_the_planner_plans_what_the_chosen_kernel_keeps():
    """Math keeps the attention weights for backward, the fused kernels do not. Planned for the CPU with [math] and
    without dropout, the estimate is the real step under [math], and larger than with PyTorch's choice (flash) by
    the weights. Planned for CUDA, a list keeps them where math would run some call: where it comes first, or
    before every kernel that takes the call at the run's precision."""
    args = ModelArgs(src_vocab=300, tgt_vocab=250, pad_id=1, attention_dropout=0.0, **TINY)
    shape = StepShape(2, 60, 60)
    for value in (None, ["math"]):
        with attention_backends(value):
            real = measure_step(args, MemoryStrategy(), shape, torch.device("cpu"))["peak"]
        assert estimate_step(args, MemoryStrategy(), shape, attention=value).peak_bytes == real, value
    flash, math = (estimate_step(args, MemoryStrategy(), shape, attention=v).peak_bytes for v in (None, ["math"]))
    # the weights of the last layer's calls at least: 4 heads x 60 x 60 fp32 for each of the 2 pairs
    assert math - flash >= 2 * 4 * 60 * 60 * 4
    # on CUDA a call runs the first kernel that takes it: flash and cuDNN half precision only, flash no mask
    for strategy in (MemoryStrategy(), MemoryStrategy(amp="bf16")):
        cuda = {v: estimate_step(args, strategy, shape, device="cuda", attention=v).peak_bytes for v in (
            None, ("efficient",), ("math", "efficient"), ("flash", "math"), ("flash", "efficient"), ("cudnn", "math"))}
        assert cuda[("efficient",)] == cuda[("flash", "efficient")] == cuda[None]
        assert cuda[("math", "efficient")] == cuda[("flash", "math")] > cuda[None]  # masked calls: math
        assert cuda[("cudnn", "math")] == (cuda[None] if strategy.amp else cuda[("flash", "math")])
        if not strategy.amp:  # the CPU plans' tensors: fused as the CPU's flash, math as its math
            assert cuda[None] == flash and cuda[("math", "efficient")] == math
    # cuDNN takes a dropout that is a multiple of 1/16 only (the models' 0.1 is not): math runs every call
    bf16 = MemoryStrategy(amp="bf16")
    for p, fused in ((0.1, False), (0.125, True)):
        dropped = dataclasses.replace(args, attention_dropout=p)
        plans = {v: estimate_step(dropped, bf16, shape, device="cuda", attention=v).peak_bytes
                 for v in (("cudnn", "math"), ("math",), ("efficient",))}
        assert (plans[("cudnn", "math")] == plans[("efficient",)] < plans[("math",)]) if fused else (
            plans[("cudnn", "math")] == plans[("math",)] > plans[("efficient",)]), p
    with pytest.raises(ConfigError, match=r"^trainer\.attention=\[efficient\]: the CPU has none"):
        estimate_step(args, MemoryStrategy(), shape, attention=["efficient"])
    with pytest.raises(ConfigError, match=r"^trainer\.attention=\[flash\]: the CPU's flash kernel runs no attention "
                                          r"dropout \(the model's is 0\.1\)"):
        estimate_step(dataclasses.replace(args, attention_dropout=0.1), MemoryStrategy(), shape, attention=["flash"])


@pytest.mark.parametrize("names, masked, half, dropout, head_dim, deterministic, kernel", [
    (None, True, True, 0.0, 64, False, "cudnn"),  # PyTorch's order on an H200
    (None, True, True, 0.1, 64, False, "efficient"),  # cuDNN: dropout a multiple of 1/16 only
    (None, False, True, 0.1, 64, False, "flash"),
    (None, True, False, 0.0, 64, False, "efficient"),  # fp32: efficient alone of the fused kernels
    (["flash", "math"], True, True, 0.0, 64, False, "math"),  # flash takes no mask
    (["flash", "math"], False, False, 0.0, 64, False, "math"),  # nor fp32
    (["cudnn", "math"], True, True, 0.0, 64, True, "math"),  # nor cuDNN deterministic algorithms
    (["cudnn", "efficient"], True, True, 0.0, 192, False, "efficient"),  # cuDNN: head size at most 128
    (["flash", "math"], False, True, 0.1, 320, False, "math"),  # flash: at most 256
    (["efficient", "math"], True, False, 0.0, 6, False, "math"),  # efficient: a multiple of 4 in fp32
    (["efficient", "math"], True, False, 0.0, 12, False, "efficient"),  # (of 4, not of 8: fp32 takes it)
    (["efficient", "math"], True, True, 0.0, 12, False, "math"),  # in half precision a multiple of 8
])
def test_the_cuda_kernel_of_a_call_is_the_first_that_takes_it(names, masked, half, dropout, head_dim, deterministic,
                                                               kernel):
    assert cuda_kernel(names, masked, half, dropout, head_dim, deterministic) == kernel


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_runs_the_kernels_the_planner_expects():
    """What the planner assumes CUDA runs (``cuda_kernel``), against what runs: a masked and a causal training call
    of the model's head size (d_model 128, 4 heads) for several lists, precisions and dropouts."""
    mask = torch.ones(2, 1, 1, 6, dtype=torch.bool, device="cuda")
    mask[0, ..., 4:] = False
    for names in (None, ["cudnn", "math"], ["flash", "efficient"], ["efficient"], ["flash", "math"]):
        for dtype, p in itertools.product((torch.bfloat16, torch.float32), (0.0, 0.1, 0.125)):
            q = torch.randn(2, 4, 6, 32, device="cuda", dtype=dtype, requires_grad=True)
            for masked in (True, False):
                with attention_backends(names), KernelsSeen() as mode:
                    try:
                        F.scaled_dot_product_attention(q, q, q, dropout_p=p, **(
                            {"attn_mask": mask} if masked else {"is_causal": True})).sum().backward()
                    except RuntimeError:  # no kernel of the list takes it: check_attention refuses the list
                        continue
                ran = mode.seen[0] if mode.seen else "math"
                assert ran == cuda_kernel(names, masked, dtype == torch.bfloat16, p, 32, False), (names, dtype, p, masked)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_list_that_trains_but_cannot_decode_is_refused_at_the_start():
    """cuDNN's attention takes no key of one position (PyTorch's check_cudnn_tensor_shapes), which decoding's first
    step attends to: [cudnn] trains a model without attention dropout in bf16 and is refused for decoding."""
    args = ModelArgs(src_vocab=8, tgt_vocab=8, pad_id=1, attention_dropout=0.0, **TINY)
    cuda = torch.device("cuda")
    with attention_backends(["cudnn"]), pytest.raises(ConfigError, match=r"decoding's first self-attention"):
        check_attention(["cudnn"], args, cuda, torch.bfloat16)
    with attention_backends(["cudnn", "math"]):
        check_attention(["cudnn", "math"], args, cuda, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_runs_flash_where_it_can_and_efficient_where_a_mask_is_needed():
    """[flash,efficient] in bf16: the decoder's causal self-attention in flash attention, the masked calls in
    memory-efficient attention; their gradients are those of math's."""
    net = model(attention_dropout=0.0, device="cuda")
    with torch.autocast("cuda", torch.bfloat16):
        seen, grads = step_grads(net, ["flash", "efficient"], "cuda")
        math, reference = step_grads(net, ["math"], "cuda")
    layers = TINY["encoder_layers"] + 2 * TINY["decoder_layers"]
    assert sorted(seen) == sorted(["flash"] * TINY["decoder_layers"] + ["efficient"] * (layers - TINY["decoder_layers"]))
    assert math == []
    # bf16: all gradients within a few percent of math's, as a whole (the key projections' biases, whose exact
    # gradient is zero, are rounding noise alone)
    ours, theirs = (torch.cat([g.float().flatten() for g in gs]) for gs in (grads, reference))
    assert (ours - theirs).norm() <= 0.05 * theirs.norm()


def test_plan_py_plans_cudnn_as_a_deterministic_run_runs_it(fast_cfg, monkeypatch):
    """trainer.deterministic takes cuDNN's attention away (PyTorch has no deterministic cuDNN attention): plan.py
    plans [cudnn,math] as math for a deterministic run and as a fused kernel otherwise, and leaves the process's
    setting as it was."""
    from omegaconf import OmegaConf

    from src.planning import plan_config

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    sizes = ["plan.src_len=60", "plan.tgt_len=60", "plan.src_vocab=300", "plan.tgt_vocab=250", "memory=amp",
             "model.attention_dropout=0.0", "trainer.attention=[cudnn,math]"]
    plans = [plan_config(OmegaConf.to_container(fast_cfg(*sizes, *extra), resolve=True))
             for extra in ([], ["trainer.deterministic=true"], ["trainer.attention=[math]"])]
    fused, deterministic, math = (est.peak_bytes for _, est, _ in plans)
    assert fused < deterministic == math
    # and plan.py says which it planned
    assert [info["attention"] for _, _, info in plans] == [{"setting": "[cudnn,math]", "math": False},
                                                           {"setting": "[cudnn,math]", "math": True},
                                                           {"setting": "[math]", "math": True}]
    assert not torch.are_deterministic_algorithms_enabled()


def test_deterministic_algorithms_hold_for_the_block_and_the_settings_before_come_back(monkeypatch):
    """trainer.deterministic sets PyTorch's deterministic kernels and turns cuDNN's benchmarking off for the run;
    a sweep's jobs share the process, so the next job finds the settings as they were (benchmarking on, here)."""
    from src.kernels import deterministic_algorithms

    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    with deterministic_algorithms(True):
        assert torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert not torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.benchmark
