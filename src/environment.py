"""What a run ran on, for its summary.json: the code's git commit, the software versions and the device. Figures
are compared across commits and machines (the README's tables name both); a summary that carries them can be
placed without the shell history that launched it."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
from importlib import metadata
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def git_state(repo: Path = REPO) -> dict:
    """The checked-out commit and whether the code differs from it: a tracked file changed, or an untracked Python
    or YAML file (a module or a config a run can read: conf/experiment/mine.yaml) not ignored; other untracked
    files (notes, plots) do not count. Nulls outside a git checkout (an unpacked archive) or without git."""
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    changes = git("status", "--porcelain", "--untracked-files=all") if commit else None
    if changes is None:
        return {"git_commit": commit, "git_dirty": None}
    code = (".py", ".yaml", ".yml")
    dirty = any(not line.startswith("??") or line.rstrip().endswith(code) for line in changes.splitlines())
    return {"git_commit": commit, "git_dirty": dirty}


def cpu_name() -> str:
    """The processor's model name (Linux: /proc/cpuinfo), else what the platform module says."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# The packages that compute a run's figures or score them (torch is its own key): their versions in summary.json
PACKAGES = ("hydra-core", "omegaconf", "numpy", "sacrebleu", "spacy", "transformers", "tokenizers", "sentencepiece",
            "wandb")


def package_versions() -> dict[str, str | None]:
    """The installed version of each of ``PACKAGES``; null for one not installed (a GPU machine without spaCy)."""
    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    return {name: version(name) for name in PACKAGES}


def usable_cores() -> list[int]:
    """The cores this process may run on: its affinity (what taskset, a container's cpuset, SLURM or
    hydra/launcher=local allows it), or every core where the system keeps no affinity (macOS)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def core_list(cores: list[int] | tuple[int, ...]) -> str:
    """Cores as ``taskset -c`` lists them: ``0-3,8``."""
    runs: list[list[int]] = []
    for core in sorted(cores):
        if runs and core == runs[-1][1] + 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def environment(device: torch.device) -> dict:
    """The run's code, software and hardware, as summary.json records them."""
    cuda = device.type == "cuda"
    return {
        **git_state(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "packages": package_versions(),
        "cuda": torch.version.cuda if cuda else None,
        "device_name": torch.cuda.get_device_name(device) if cuda else cpu_name(),
        "cpu": cpu_name(),
        "host": socket.gethostname(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),  # a sweep job's GPUs (hydra/launcher=local)
        "cpu_affinity": core_list(usable_cores()),  # and its cores
    }
