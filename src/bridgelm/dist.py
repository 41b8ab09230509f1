"""Where this process sits in a run, and the collectives every multi-process run (training or evaluation) uses.

Design notes:
- One function decides the device of a process, `rank_device`: under torchrun a CUDA request is the rank's own GPU
  (cuda:LOCAL_RANK), so that every model and every copy of one is made there, never first on cuda:0.
- One `Dist` describes the process: rank, world size, local rank, device, and whether the model is FSDP-sharded.
  `Dist.from_env()` reads what torchrun set (RANK, WORLD_SIZE, LOCAL_RANK) without joining a process group: an eval
  run samples its shard without any collective. `setup_distributed` joins the group (training needs collectives
  from the start), whose collectives wait `DistConfig.dist_timeout` minutes (--dist-timeout) for the slowest rank;
  `barrier` joins one for the moment when none exists (an eval run's final wait).
- Data parallel without wrappers: each rank runs its own groups, the loss is normalised by the GLOBAL token count
  (`all_reduce_sum`), and gradients are summed with one all-reduce per bucket (`reduce_gradients`). With
  `fsdp=True` each decoder layer (holding its Bridge block) and then the root are `fully_shard`-ed; FSDP sums the
  gradients itself (divide factor 1); with bf16 in mixed precision (fp32 master weights and reductions, bf16
  compute, `MixedPrecisionPolicy`). Generation under FSDP runs on unsharded parameters (`unsharded`), because
  ranks decode different numbers of steps and must not meet in collectives there; or (rl's rollouts in bf16) on a
  plain replica filled parameter by parameter (`gather_into`: cast, then all-gathered).
- Checkpoints under FSDP: each rank writes and reads its own shards of model and optimiser (`save_shards`,
  `load_model_shards`, `load_optimizer_shards`: torch.distributed.checkpoint, read through bridgelm.shards, which
  unpickles nothing freely); only a model folder
  (save_pretrained) gathers the weights to rank 0 (`full_state_dict`).

Used by bridgelm.eval.runner and bridgelm.train; tested by tests/test_train_distributed.py (torchrun, gloo, CPU).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as torch_dist

from bridgelm.errors import UserError, check_number
from bridgelm.setting import setting

Bundle = TypeVar("Bundle")
MAX_TIMEOUT = 365 * 24 * 60.0  # minutes: the longest --dist-timeout
# How long ranks that sample their own share of problems (eval, warmup-data) wait at the end for the slowest one.
SLOWEST_RANK_TIMEOUT = timedelta(days=3)


@dataclass
class DistConfig:
    """How the processes of a torchrun launch wait for each other (no trained weight depends on it)."""

    dist_timeout: float = setting(60.0, "minutes a collective waits for the slowest rank before "
                                        "the run fails (uneven long rollouts, rank 0 gathering "
                                        "a large checkpoint); torch's own default is 10")

    def validate(self) -> None:  # at most a year: torch keeps the timeout in milliseconds of a C++ int
        check_number("dist_timeout", self.dist_timeout, 0, MAX_TIMEOUT, open_low=True, note=" (minutes)")


@dataclass
class Dist:
    """This process's place in a (possibly single-process) run."""

    rank: int = 0  # global rank
    world: int = 1  # number of processes
    local_rank: int = 0  # rank on this machine (picks the GPU)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # where this rank computes
    fsdp: bool = False  # parameters are sharded with FSDP2

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def owns(self, index: int) -> bool:
        """Item `index` of a list sharded round-robin over the ranks belongs to this rank."""
        return index % self.world == self.rank

    @staticmethod
    def from_env(device: str | torch.device | None = None) -> Dist:
        """The place torchrun describes through RANK / WORLD_SIZE / LOCAL_RANK (one process when unset); joins nothing.
        Its device is `rank_device(device)`."""
        world, rank, local = _torchrun_env()
        place = rank_device(device)
        check_device(place)
        place = torch.device(place)
        if world == 1:
            return Dist(device=place)
        end_with_launcher()
        return Dist(rank, world, local, place)


_ENDS_WITH_LAUNCHER = False


def end_with_launcher() -> None:
    """Under torchrun on Linux, once a process: SIGTERM this rank when its launcher dies (kill -9 of torchrun would
    leave the ranks running on, then waiting at the slowest rank's barrier for the whole timeout, holding the output's
    lock). A SIGTERM ends a rank as Ctrl-C does: what it finished is kept. The launcher is the rank's parent process:
    with a wrapper between them (`torchrun --no-python bash -c ...`) it is the wrapper that is watched."""
    global _ENDS_WITH_LAUNCHER
    if _ENDS_WITH_LAUNCHER or not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    _ENDS_WITH_LAUNCHER = True
    import ctypes
    import signal

    launcher = os.getppid()
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: a signal when the parent ends
    if os.getppid() != launcher:  # it ended before the call
        os.kill(os.getpid(), signal.SIGTERM)


def _torchrun_env() -> tuple[int, int, int]:
    """(WORLD_SIZE, RANK, LOCAL_RANK) as torchrun sets them; (1, 0, 0) in a plain process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world < 1 or not 0 <= rank < world:
        raise UserError(f"RANK={rank} and WORLD_SIZE={world} must satisfy 0 <= RANK < WORLD_SIZE")
    return world, rank, int(os.environ.get("LOCAL_RANK", str(rank)))


def rank_device(requested: str | torch.device | None) -> str:
    """The device this process computes on, decided once, before any model or copy is made (every command asks here).

    One process: `requested` as it is (None: cpu). Under torchrun (WORLD_SIZE > 1) a CUDA request (cuda, cuda:i)
    becomes cuda:LOCAL_RANK, the rank's own GPU, whatever index it named; None becomes cuda:LOCAL_RANK when CUDA is
    available, else cpu; any other request stays as it is. A device this machine lacks (cuda:LOCAL_RANK beyond its
    GPUs) is refused by `check_device` (Dist.from_env asks it) in one line.
    """
    world, _, local = _torchrun_env()
    wanted = "cpu" if requested is None and (world == 1 or not torch.cuda.is_available()) else str(requested or "cuda")
    if world > 1 and wanted.split(":")[0] == "cuda":
        return f"cuda:{local}"
    return wanted


def check_device(device: str | torch.device) -> None:
    """UserError unless `device` names a device of this machine (cpu, cuda:i with i < the GPU count, mps, meta)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise UserError(f"device {device!r} is not a device name: expected cpu, cuda, cuda:0, ...") from err
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise UserError(
                f"device {device!r}: this machine has no CUDA GPU (or torch was built without CUDA); use cpu"
            )
        if dev.index is not None and dev.index >= count:
            raise UserError(f"device {device!r}: this machine has {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"device {device!r}: MPS is not available on this machine; use cpu")


def setup_distributed(device: str | torch.device | None = None, timeout_minutes: float | None = None) -> Dist:
    """`Dist.from_env(device)`, having joined the torchrun process group when there are several processes.

    NCCL on CUDA, else gloo; a collective waits `timeout_minutes` (None: DistConfig's default) for the slowest rank.
    A process group that already exists is used as it is (the commands join it first, with --dist-timeout).
    """
    place = Dist.from_env(device)
    if place.world == 1 and not torch_dist.is_initialized():
        return place
    if not torch_dist.is_initialized():
        if place.device.type == "cuda":
            torch.cuda.set_device(place.device)
        minutes = DistConfig.dist_timeout if timeout_minutes is None else timeout_minutes
        backend = "nccl" if place.device.type == "cuda" else "gloo"
        torch_dist.init_process_group(backend=backend, timeout=timedelta(minutes=minutes))
    return Dist(torch_dist.get_rank(), torch_dist.get_world_size(), place.local_rank, place.device)


def teardown_distributed(wait: bool = True) -> None:
    """Leave the process group. With `wait` (a normal end), every rank first meets at a barrier, so that none tears
    its transport down while another still talks to it (gloo can abort a rank then); without it (an error path,
    where another rank may never come), at once."""
    if torch_dist.is_initialized():
        if wait and torch_dist.get_world_size() > 1:
            torch_dist.barrier()
        torch_dist.destroy_process_group()


def barrier(dist: Dist, timeout: timedelta | None = None) -> None:
    """Wait until every rank gets here. Without a process group, one is joined (gloo, CPU and GPU alike) for the
    wait alone, with `timeout` (an eval run's ranks meet only once, when the slowest shard is done)."""
    if dist.world == 1:
        return
    if torch_dist.is_initialized():
        torch_dist.barrier()
        return
    kwargs = {} if timeout is None else {"timeout": timeout}
    met: list[BaseException | None] = []

    def meet() -> None:  # joining blocks until every rank joins, and the barrier until every rank is there
        try:
            torch_dist.init_process_group("gloo", rank=dist.rank, world_size=dist.world, **kwargs)
            torch_dist.barrier()
            met.append(None)
        except BaseException as err:  # noqa: BLE001 - raised again in the main thread
            met.append(err)

    # In a thread of its own, so that Ctrl-C or SIGTERM ends a rank waiting here at once: Python runs its signal
    # handlers in the main thread, and only between bytecodes (torchrun would kill a rank blocked in C++ after 30 s).
    # Interrupted, the thread is left waiting: the process is expected to end (the commands do).
    waiting = threading.Thread(target=meet, name="bridgelm-barrier", daemon=True)
    waiting.start()
    while waiting.is_alive():
        waiting.join(0.1)
    if torch_dist.is_initialized():
        torch_dist.destroy_process_group()
    if met[0] is not None:
        raise met[0]


def all_reduce_sum(values: Sequence[float], dist: Dist) -> list[float]:
    """Sums of `values` over ranks (one collective for the whole list)."""
    if dist.world == 1:
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=dist.device)
    torch_dist.all_reduce(t)
    return t.tolist()


def all_reduce_fields(bundle: Bundle, dist: Dist) -> Bundle:
    """A copy of the dataclass `bundle` (number fields only) with each field summed over ranks, in one collective."""
    names = [f.name for f in fields(bundle)]
    sums = all_reduce_sum([getattr(bundle, name) for name in names], dist)
    return replace(bundle, **dict(zip(names, sums, strict=True)))


def all_reduce_max(values: Sequence[int], dist: Dist) -> list[int]:
    """Maxima of the integers `values` over ranks (one collective for the whole list)."""
    if dist.world == 1:
        return [int(v) for v in values]
    t = torch.tensor([int(v) for v in values], dtype=torch.int64, device=dist.device)
    torch_dist.all_reduce(t, op=torch_dist.ReduceOp.MAX)
    return [int(v) for v in t.tolist()]


def broadcast_parameters(model: torch.nn.Module, dist: Dist) -> None:
    """Make every rank hold rank 0's parameters and buffers (e.g. blocks initialised from different RNGs)."""
    if dist.world == 1:
        return
    with torch.no_grad():
        for t in model.state_dict().values():
            torch_dist.broadcast(t, src=0)


def reduce_gradients(params: Sequence[torch.nn.Parameter], dist: Dist, bucket: int = 2**25) -> None:
    """Sum gradients over ranks in place: one all-reduce per bucket of ~`bucket` elements of one dtype."""
    if dist.world == 1 or dist.fsdp:
        return
    buckets: list[list[torch.nn.Parameter]] = []
    open_bucket: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)  # every rank must contribute the same layout
        group = open_bucket.setdefault(p.grad.dtype, [])
        if group and sum(q.numel() for q in group) + p.numel() > bucket:
            buckets.append(group)
            group = open_bucket[p.grad.dtype] = []
        group.append(p)
    buckets += [g for g in open_bucket.values() if g]
    for group in buckets:
        flat = torch.cat([p.grad.reshape(-1) for p in group])
        torch_dist.all_reduce(flat)
        at = 0
        for p in group:
            n = p.grad.numel()
            p.grad.copy_(flat[at : at + n].view_as(p.grad))
            at += n


def bf16_supported(device: torch.device) -> bool:
    """Whether `device` computes in bfloat16: a CUDA GPU that has it (Ampere and later), or the CPU."""
    return torch.cuda.is_bf16_supported() if device.type == "cuda" else device.type == "cpu"


def shard_model(model: torch.nn.Module, dist: Dist, bf16: bool = False) -> torch.nn.Module:
    """FSDP2: shard each decoder layer (with its Bridge/P-Match block inside), then the root. Sums gradients.

    `bf16` on a device that has it: mixed precision (fp32 master weights and optimiser, each layer gathered in
    bf16 for its forward and backward, gradients reduced in fp32)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    from bridgelm.layout import decoder_layers

    mesh = init_device_mesh(dist.device.type, (dist.world,))
    mixed = bf16 and bf16_supported(dist.device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else None
    kwargs = {"mesh": mesh} if policy is None else {"mesh": mesh, "mp_policy": policy}
    for layer in decoder_layers(model):
        fully_shard(layer, reshard_after_forward=True, **kwargs)
    fully_shard(model, reshard_after_forward=False, **kwargs)
    for module in model.modules():  # neither setting is recursive
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # sum: the loss is already normalised by the global token count
            module.set_force_sum_reduction_for_comms(True)  # plain sums (gloo has no pre-multiplied sum)
    dist.fsdp = True
    return model


@contextmanager
def unsharded(model: torch.nn.Module, dist: Dist) -> Iterator[None]:
    """Under FSDP: gather all parameters once, so that forwards (generation) need no collectives; reshard after."""
    if not dist.fsdp:
        yield
        return
    from torch.distributed.fsdp import FSDPModule

    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in modules:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield
    finally:
        for m in modules:
            m.reshard()
            m.set_reshard_after_forward(m is not model, recurse=False)


def gather_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy the whole of parameter `src` into `dst` (a plain tensor of its full shape), in dst's dtype. Under FSDP
    (`src` a sharded DTensor) each rank's shard is cast to that dtype first, then all-gathered: the whole tensor
    exists only in dst's dtype. A collective then: every rank calls it, for the same parameters in the same order."""
    with torch.no_grad():
        if hasattr(src, "full_tensor"):
            src = src.detach().to(dst.dtype).full_tensor()
        dst.copy_(src)


def prepare_model(model: torch.nn.Module, dist: Dist, fsdp: bool, bf16: bool = False) -> torch.nn.Module:
    """Move to this rank's device, make ranks agree on the weights, and shard when asked (in mixed precision with
    `bf16`: see `shard_model`)."""
    if fsdp and dist.world == 1:
        raise UserError("fsdp=True needs several processes: launch with torchrun --nproc_per_node N")
    model.to(dist.device)
    broadcast_parameters(model, dist)
    if fsdp:
        shard_model(model, dist, bf16)
    return model


def full_state_dict(model: torch.nn.Module, dist: Dist) -> dict[str, torch.Tensor] | None:
    """Under FSDP: the gathered state dict on rank 0 (collective; {} on other ranks). Else None (use the model's)."""
    if not dist.fsdp:
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: str | os.PathLike) -> None:
    """Under FSDP: each rank writes its own shards of the model and of the optimiser state into `folder`
    (torch.distributed.checkpoint; collective, nothing gathered)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optimizer_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optimizer": optimizer_sd}, checkpoint_id=str(folder))


def load_model_shards(model: torch.nn.Module, folder: str | os.PathLike) -> None:
    """Under FSDP: each rank reads its own shards of the model's weights from `folder` (written by `save_shards`)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from bridgelm.shards import load_shards

    state = {"model": get_model_state_dict(model)}
    load_shards(state, folder)  # nothing in the folder unpickled freely
    set_model_state_dict(model, state["model"])


def load_optimizer_shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: str | os.PathLike) -> None:
    """Under FSDP: each rank reads its own shards of the optimiser state from `folder` (written by `save_shards`)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    from bridgelm.shards import load_shards

    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}  # the layout to fill (AdamW's zero state)
    # partial: a trainable parameter that never had a gradient (a composite model's vision tower in a text run) has
    # no state in the shards, and keeps its zero state here: AdamW passes it over, as it did before the stop
    load_shards(state, folder, partial=True)
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state["optimizer"])
