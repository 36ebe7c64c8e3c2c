"""Data-parallel training through PyTorch's own runtime: ``torchrun --nproc_per_node=N train.py ...``.

torchrun starts N processes and sets RANK, LOCAL_RANK and WORLD_SIZE; each process joins one process group
(``nccl`` on GPUs, ``gloo`` on the CPU) and trains a replica wrapped in DistributedDataParallel (or, with
``memory=fsdp``, a model sharded by FSDP2's ``fully_shard``). One optimizer step takes N consecutive batches of
the epoch's length-bucketed order, one per rank, so an epoch still sees every example once; the step's loss is
divided by the target tokens of all N batches, so N ranks make the update one process makes on the same N
batches accumulated. Rank 0 alone logs, writes checkpoints and evaluates; the other ranks wait for it.

A sweep's job can be such a run too: with ``hydra/launcher=slurm hydra.launcher.tasks_per_node=N`` (or
``nodes``), submitit starts the job's N tasks, each one rank (``world_from_env``).
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .errors import ConfigError

_host_group: dist.ProcessGroup | None = None  # gloo beside NCCL for World.any (None: the default group, gloo)
# How long the other ranks wait for each machine's first to read and tokenize the corpus (World.local_main_first),
# and for rank 0's validations and test (``long_wait``), on a gloo group of their own: a WMT-sized corpus, or
# beam search over a large test set on the CPU, takes longer than the process group's 30 minutes, after which the
# barrier failed the run. (A monitored barrier's timeout does not cover its sends.) A rank that fails instead
# ends the wait at once: torchrun stops the others.
DATA_WAIT = datetime.timedelta(hours=12)
_data_group: dist.ProcessGroup | None = None


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def device(self, device: torch.device) -> torch.device:
        """One GPU per rank: this rank's (LOCAL_RANK) when the run is on CUDA; in a submitit job whose task sees
        one GPU alone (SLURM binds a GPU to each task with gpus_per_task=1), that one."""
        if device.type == "cuda" and self.distributed:
            count = torch.cuda.device_count()
            if count == 1 and os.environ.get("SUBMITIT_EXECUTOR") == "slurm":
                return torch.device("cuda", 0)
            if self.local_rank >= count:
                who, fix = (("submitit", f"hydra.launcher.tasks_per_node={count}") if os.environ.get("SUBMITIT_EXECUTOR")
                            else ("torchrun", f"--nproc_per_node={count}"))
                raise ConfigError(f"{who} started more processes on this machine than it has GPUs ({count} "
                                  f"visible; this is LOCAL_RANK {self.local_rank}): {fix}")
            return torch.device("cuda", self.local_rank)
        return device

    def barrier(self, long_wait: bool = False) -> None:
        """Every rank here; ``long_wait``: for rank 0's evaluation, up to ``DATA_WAIT``."""
        if self.distributed:
            dist.barrier(group=_data_group if long_wait else None)

    @contextlib.contextmanager
    def local_main_first(self):
        """Each machine's first process (LOCAL_RANK 0) runs the body before the others, which then run it too:
        reading and tokenizing a corpus once per machine, into the cache the others then load, instead of once
        per GPU at the same time (machines sharing a cache tokenize once between them: the cache file's lock,
        src/data/encode.py). An error in the first still lets the others go on (to fail the same way). The others
        wait up to ``DATA_WAIT``."""
        if self.distributed and self.local_rank != 0:
            dist.barrier(group=_data_group)
        try:
            yield
        finally:
            if self.distributed and self.local_rank == 0:
                dist.barrier(group=_data_group)

    def all_sum(self, values: list[float | torch.Tensor], device: torch.device) -> list[float]:
        """Sums of ``values`` over the ranks (one collective), as Python numbers."""
        t = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in values])
        if self.distributed:
            dist.all_reduce(t)
        return t.tolist()

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank. On the host (gloo, beside NCCL on GPUs): unlike an all-reduce on the
        GPU, it does not wait for the GPU's queue, so it adds no host sync to a step."""
        if not self.distributed:
            return flag
        t = torch.tensor([int(flag)])
        dist.all_reduce(t, group=_host_group)
        return bool(t.item())

    def broadcast(self, obj, long_wait: bool = False):
        """Rank 0's ``obj`` on every rank; ``long_wait``: as ``barrier``'s."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=_data_group if long_wait else None)
        return box[0]

    def gather(self, obj) -> list:
        """Every rank's ``obj``, in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        out = [None] * self.size
        dist.all_gather_object(out, obj)
        return out


def average_gradients(params, world: World, bucket_bytes: int = 25 * 2**20) -> int:
    """DDP's gradient averaging after backward instead of during it: the gradients, flattened into buckets of up to
    ``bucket_bytes`` (DDP's default size) of one dtype, summed over the ranks and divided by their number. Returns
    the number of all-reduces."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for g in (p.grad for p in params if p.grad is not None):
        if not buckets or size + g.nbytes > bucket_bytes or g.dtype != buckets[-1][0].dtype:
            buckets.append([])
            size = 0
        buckets[-1].append(g)
        size += g.nbytes
    for bucket in buckets:
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat)
        flat.div_(world.size)
        for g, synced in zip(bucket, flat.split([g.numel() for g in bucket])):
            g.copy_(synced.view_as(g))
    return len(buckets)


def world_from_env() -> World:
    """What torchrun set; in a job of several tasks that submitit started (hydra/launcher=slurm or local with
    ``tasks_per_node`` or ``nodes`` above 1), the same variables, exported by submitit's
    ``TorchDistributedEnvironment`` from the job's (each task one rank; its GPU is picked by LOCAL_RANK, as under
    torchrun, so CUDA_VISIBLE_DEVICES is left as the job has it); else a single process."""
    if "WORLD_SIZE" not in os.environ and submitit_tasks() > 1:
        from submitit.helpers import TorchDistributedEnvironment

        TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
    size = int(os.environ.get("WORLD_SIZE", "1"))
    return World(rank=int(os.environ.get("RANK", "0")), size=size, local_rank=int(os.environ.get("LOCAL_RANK", "0")))


def submitit_tasks() -> int:
    """The number of tasks of the submitit job this process is one of (1 outside a submitit job)."""
    if not os.environ.get("SUBMITIT_EXECUTOR"):
        return 1
    from submitit import JobEnvironment

    return JobEnvironment().num_tasks


def shared_cores_tasks() -> int:
    """The ranks that share this machine's cores without being told how many threads to run: the tasks of a job of
    submitit's local executor (hydra/launcher=local hydra.launcher.tasks_per_node=N), each of which PyTorch gives a
    thread per core (N times too many: 2 tasks trained 8 times slower on 2 cores). 0 where they do not share them:
    torchrun sets OMP_NUM_THREADS=1 for its processes, and SLURM gives each task cpus_per_task cores of its own.
    With OMP_NUM_THREADS set, its count stands."""
    if os.environ.get("SUBMITIT_EXECUTOR") != "local" or "OMP_NUM_THREADS" in os.environ:
        return 0
    tasks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return tasks if tasks > 1 else 0


def check_one_slurm_task(world: World) -> None:
    """SLURM's several tasks of one job, started without submitit or torchrun (``srun python train.py``), would
    each train the whole run, into one run directory. A submitit job's tasks are the ranks of one run
    (``world_from_env``), as torchrun's processes are."""
    tasks = int(os.environ.get("SLURM_NTASKS", "1") or 1)
    if tasks > 1 and not world.distributed:
        raise ConfigError(f"SLURM started {tasks} tasks of this job, each of which would train the whole run: "
                          "launch them with hydra/launcher=slurm hydra.launcher.tasks_per_node=N (each task one "
                          "rank), or run torchrun --nproc_per_node=N train.py ... inside one task")


@contextlib.contextmanager
def process_group(world: World, device: torch.device, timeout_min: float = 30):
    """Join the process group for the length of the run (nothing to do for a single process)."""
    if not world.distributed or dist.is_initialized():
        yield
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    global _host_group, _data_group
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=world.rank, world_size=world.size,
                            timeout=datetime.timedelta(minutes=timeout_min))
    _host_group = dist.new_group(backend="gloo") if backend == "nccl" else None
    _data_group = dist.new_group(backend="gloo", timeout=DATA_WAIT)
    try:
        yield
    finally:
        _host_group = _data_group = None
        dist.destroy_process_group()


def ddp_bucket_bytes(net: torch.nn.Module) -> int:
    """The bytes of DDP's gradient buckets, one copy of every gradient that its reducer keeps for the whole run
    (``gradient_as_bucket_view`` off, DDP's default); 0 for a module DDP does not wrap."""
    if not isinstance(net, torch.nn.parallel.DistributedDataParallel):
        return 0
    return sum(p.numel() * p.element_size() for p in net.parameters() if p.requires_grad)


def fully_shard_net(net: torch.nn.Module, param_dtype: torch.dtype | None = None) -> None:
    """memory=fsdp: FSDP2 (``fully_shard``) over the ranks, one unit per encoder and decoder layer and one for the
    rest (embeddings, final norms, output projection: tied weights stay in one unit), with ``net`` (the
    trainer's LossModule, whose forward is the whole step) as the root. Each unit's parameters are gathered
    while it computes and freed after; gradients are reduce-scattered, so each rank keeps 1/N of them and of
    Adam's state.

    The embeddings stay in the root. As units of their own (304b200, reverted) FSDP2 reduce-scattered their
    gradients only at the end of backward, in the root's final callback (their input, token ids, takes no
    gradient, to which FSDP attaches a unit's post-backward hook), holding the target table gathered and its full
    gradient through the encoder's backward: one step of a large untied vocabulary's small batch peaked 4% higher
    (experiments/distributed/fsdp_peaks.py), for 3.7% lower on the reference workload.

    ``param_dtype`` (memory.fsdp_param_dtype): each unit gathers its parameters in that dtype and casts the floating
    tensors of its input to it (FSDP2's ``MixedPrecisionPolicy``); gradients are reduce-scattered in fp32, into the
    fp32 shards that Adam steps."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    model = net.model
    for layer in [*model.encoder, *model.decoder]:
        fully_shard(layer, mp_policy=policy)
    fully_shard(net, mp_policy=policy)


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, sharded: bool) -> tuple[dict, dict]:
    """The model's and the optimizer's state dicts as one process holds them. memory=fsdp: gathered from the
    shards into CPU memory, on rank 0 (a collective: every rank calls it); the optimizer's state is then keyed
    by parameter name, so such a checkpoint resumes with memory=fsdp."""
    if not sharded:
        return model.state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return (get_model_state_dict(model, options=options),
            get_optimizer_state_dict(model, optimizer, options=options))


def load_full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_state: dict, optim_state: dict,
                    sharded: bool) -> None:
    """``full_state``'s inverse: each rank keeps its shard of the full tensors. A checkpoint written without FSDP
    (one process, DDP) keys the optimizer's state by parameter number: FSDP's loader takes names (it raised
    KeyError: 'state.0.step')."""
    if not sharded:
        model.load_state_dict(model_state)
        optimizer.load_state_dict(optim_state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    if any(isinstance(p, int) for group in optim_state["param_groups"] for p in group["params"]):
        # the numbers count the optimizer's parameters group by group, as state_dict() numbers them
        name_of = {id(p): name for name, p in model.named_parameters()}
        names = [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]
        optim_state = {"state": {names[i]: v for i, v in optim_state["state"].items()},
                       "param_groups": [{**g, "params": [names[i] for i in g["params"]]}
                                        for g in optim_state["param_groups"]]}
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_state, options=options)
    set_optimizer_state_dict(model, optimizer, optim_state, options=options)


class RankSteps(Sequence):
    """(this rank's batch, whether it is real, the step's batches on all ranks) for each optimizer step: step
    ``s`` takes batches ``s*N .. s*N+N-1`` of the epoch's order, batch ``s*N + rank`` for this rank. When the
    epoch's last step has fewer than N batches, a rank without one repeats the step's first batch, marked not
    real (fairseq's dummy batch): it runs forward and backward so the collectives stay in step, and its loss
    is multiplied by 0. Every example counts once per epoch. Each step's lists are made as it is taken, so an
    epoch's batches stay in ``EpochBatches``' one tensor."""

    def __init__(self, order: Sequence[list[int]], world: World):
        self.order, self.world = order, world

    def __len__(self) -> int:
        return -(-len(self.order) // self.world.size)

    def __getitem__(self, s: int) -> tuple[list[int], bool, list[list[int]]]:
        s = range(len(self))[s]
        group = list(self.order[s * self.world.size:(s + 1) * self.world.size])
        real = self.world.rank < len(group)
        return group[self.world.rank] if real else group[0], real, group
