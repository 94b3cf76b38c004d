"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): atomic saves, exact resume.

Layout of ``checkpoint.save`` (Megatron's names)::

    <save>/
      latest_checkpointed_iteration.txt   "20" -- the tracker, replaced atomically by rank 0
      iter_0000010/                       a complete checkpoint
        .metadata                         DCP's index, written last by the coordinator
        __0_0.distcp  __1_0.distcp        DCP data (each replicated tensor once, spread over ranks)
        config.yaml                       the run's resolved config, for people
      iter_0000020.tmp-5c1e9a/            a save in progress, or one killed midway: never loaded

Atomicity. Every rank writes into ``iter_NNNNNNN.tmp-<random>/`` (rank 0 picks
the name and tells the others); after all ranks finished (DCP gathers them at
its end, then a barrier), rank 0 renames the folder to ``iter_NNNNNNN/``
(one ``os.rename``) and replaces the tracker file through a temporary file
and ``os.replace``. A process killed at any moment therefore leaves either
the previous checkpoint or the new one complete, and the loader never reads
a ``.tmp-*`` folder: it follows the tracker, and when the tracker is missing,
unreadable or names a folder that is not there, takes the newest complete
``iter_*`` folder. Before loading, the trainer verifies the chosen folder
(*Verification* below): a damaged one is skipped with a warning naming the
damaged file, for the newest intact one.

What a checkpoint holds -- everything an uninterrupted run would carry from
one iteration to the next, so a resumed run's losses are bit-identical:

* ``iteration``;
* ``model.*``: parameters and persistent buffers (e.g. MoE expert biases);
* ``optimizer.*``: the step counter (the LR is computed from it on the
  device), fp32 master weights, ``exp_avg``, ``exp_avg_sq``, by parameter name;
  under tensor parallelism or FSDP2 (parallel/) both are DTensors
  in the parameters' natural layout (*Sharded parameters* below), so a run
  of another layout -- or one GPU -- loads them, DCP resharding; a
  parameter that is its own fp32 master weight (an fp32 parameter, FSDP2's
  fp32 shard) is loaded from ``optimizer.master``, as a layout of bf16
  parameters saved only their rounded copy under ``model.*``;
* ``scheduler.*``: the LR schedule's settings (checked on resume);
* ``rng.rank<r>.*``: every RNG-tracker stream, torch's CPU and CUDA default
  generators and Python's ``random``, per rank (each pipeline stage and
  tensor-parallel rank has streams of its own);
* ``data.train.*`` / ``data.valid.*``: the data iterators' positions;
* ``meta.world_size``, ``meta.layout`` (pipeline stages, data-parallel
  replicas, tensor-parallel ranks).

Adapter-only checkpoints. With ``peft=lora`` or ``peft=dora`` the base weights are frozen and never change,
so ``model.*`` holds only the trainable parameters (the adapters; :func:`adapter_keys`) -- the optimizer
state is theirs alone anyway -- and ``meta.base`` records where the base weights came from
(``checkpoint.pretrained_checkpoint=...``, ``model.hf_path=...`` or ``rng.seed=...``: :func:`base_source`).
A resumed run builds the base from its own config, loads the adapters over it and refuses a checkpoint whose
``meta.base`` differs from its own source (its adapters fit only that base); a run without adapters, or
``checkpoint.pretrained_checkpoint``, refuses an adapter-only checkpoint. The checkpoint is as small as the
adapters (a few percent of a full one at rank 8) and resumes bit-exactly.

RNG streams on resume (:func:`rng_source_rank`): each rank takes the streams
saved by the rank that had its place -- the same pipeline stage and
tensor-parallel rank, and its data-parallel replica (the first one when the
checkpoint has fewer) -- so at the same layout every rank continues its own
streams, bit-exactly. A rank whose stage or tensor-parallel rank the
checkpoint does not have keeps the streams this run seeded for it (Megatron
ignores the RNG state on a (TP, PP) change); the log says so.

Loading copies into the existing tensors (DCP loads in place), so addresses
that graphs captured stay valid; graphs are still captured after the resume
(warm-up counts from the resume iteration) because the runner is built after
loading.

Sharded parameters: what a sharded parameter puts in a checkpoint, so that a
run of any layout can load it. DCP saves a DTensor as its shards with their
global offsets and loads it into any other sharding -- FSDP2's shards of 2
ranks into 1 rank's whole tensor, tensor-parallel shards into FSDP2's. That
holds as long as the DTensor's global tensor is the parameter in its
natural layout, which is true of every parameter but one kind: a *fused*
projection sharded for tensor parallelism (``linear_qkv``, ``linear_fc1``:
parallel/tensor_parallel.py's ``FusedColwiseParallel``), whose rows each rank holds
part by part, so its DTensor's global rows are ordered per rank. For those
the checkpoint holds the natural tensor (q, k, v or gate, up, whole) on every
rank -- gathered when saving, sliced back into the local part after loading --
under the same key a one-GPU run uses. Every other DTensor is saved as it is,
and the optimizer's local state tensors are saved as DTensors shaped like
their parameter.

:class:`LayoutEntries` builds those entries for a DCP state dict; after
``dcp.load`` filled it, :meth:`LayoutEntries.finish_load` copies the fused
parameters' natural tensors into the local shards.

Verification: which checkpoint to resume from, verified before anything is loaded (a damaged one is skipped
for the newest intact one): training/checkpoint_select.py.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import secrets
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint.api import CheckpointException
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from ..config import CheckpointConfig, Config
from ..config_files import save_yaml
from ..converters.lora import LoRALinear
from ..cuda_graph.rng import get_rng_tracker
from ..engines_compat import dtensor_local
from ..errors import CheckpointError
# choosing a checkpoint (re-exported: the loop and the tools import them from here)
from .checkpoint_select import (ITER_DIR, TRACKER, choose_checkpoint, find_checkpoint,  # noqa: F401
                                intact_checkpoints, iter_dir_name, verify_checkpoint)
from .distributed import DataParallel
from .optim import AdamW
from ..parallel.tensor_parallel import fused_parts, part_slice, tensor_parallel_split

log = logging.getLogger("graphstep")


# --------------------------------------------------------------------------
# the parameters' layout


def to_natural(rows: torch.Tensor, parts: tuple[int, ...], ranks: int, dim: int = 0) -> torch.Tensor:
    """Per-rank part order along ``dim`` (rank 0's slice of each part, then rank 1's ...) -> parts whole, in order."""
    blocks = [block.split([n // ranks for n in parts], dim) for block in rows.chunk(ranks, dim)]
    return torch.cat([torch.cat([blocks[r][i] for r in range(ranks)], dim) for i in range(len(parts))], dim)


def to_per_rank(rows: torch.Tensor, parts: tuple[int, ...], ranks: int, dim: int = 0) -> torch.Tensor:
    """The inverse of :func:`to_natural`: every rank's slice (tensor_parallel.py ``part_slice``), in rank order."""
    return torch.cat([part_slice(rows, parts, r, ranks, dim) for r in range(ranks)], dim)


class LayoutEntries:
    """Checkpoint entries of a run's parameters and optimizer state, for any layout."""

    def __init__(self) -> None:
        self._after_load: list[Callable[[], None]] = []

    def entry(self, value: torch.Tensor, like: torch.Tensor, parts: tuple[int, ...] | None) -> torch.Tensor:
        """What the checkpoint holds for ``value``: a parameter, or a local state tensor of parameter ``like``."""
        if not isinstance(like, DTensor):
            return value
        dt = value if isinstance(value, DTensor) else DTensor.from_local(
            value, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride())
        dim, ranks = tensor_parallel_split(like)
        if parts is None or ranks == 1:
            return dt
        with torch.no_grad():
            natural = to_natural(dt.detach().full_tensor(), parts, ranks, dim)
        local = dtensor_local(dt)

        def scatter() -> None:  # after loading: this rank's share of the natural tensor, in place
            with torch.no_grad():
                per_rank = to_per_rank(natural, parts, ranks, dim)
                local.copy_(distribute_tensor(per_rank, like.device_mesh, like.placements, src_data_rank=None)
                            .to_local())

        self._after_load.append(scatter)
        return natural

    def model(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """``model.state_dict()`` with the fused tensor-parallel parameters in their natural layout; of a model with
        adapters, only the entries an adapter-only checkpoint holds (:func:`adapter_keys`)."""
        owners = {f"{prefix}.{name}" if prefix else name: fused_parts(module)
                  for prefix, module in model.named_modules() for name, _ in module.named_parameters(recurse=False)}
        keep = adapter_keys(model)
        return {key: self.entry(t, t, owners.get(key)) for key, t in model.state_dict().items()
                if keep is None or key in keep}

    def finish_load(self) -> None:
        for scatter in self._after_load:
            scatter()
        self._after_load.clear()


# --------------------------------------------------------------------------
# adapter-only checkpoints


def adapter_keys(model: nn.Module) -> set[str] | None:
    """The model entries an adapter-only checkpoint holds -- the trainable parameters (the adapters) and the
    buffers -- of a model with LoRA/DoRA adapters (peft set); None for any other model (a full checkpoint).

    The frozen base weights are left out: a resumed run rebuilds them from the source it started from
    (:func:`base_source`), which the checkpoint records as ``meta.base``."""
    if not any(isinstance(m, LoRALinear) for m in model.modules()):
        return None
    params = dict(model.named_parameters())
    return {k for k in model.state_dict() if k not in params or params[k].requires_grad}


def base_source(config: Config) -> str:
    """Where a run's frozen base weights come from, as the field that names it."""
    if config.checkpoint.pretrained_checkpoint:
        return f"checkpoint.pretrained_checkpoint={Path(config.checkpoint.pretrained_checkpoint).resolve()}"
    if config.model.hf_path:
        return f"model.hf_path={Path(config.model.hf_path).resolve()}"
    return f"rng.seed={config.rng.seed}"  # initialised from the seed, no pretrained weights


def saved_base(path: Path, dp: DataParallel) -> str | None:
    """The base an adapter-only checkpoint's adapters were trained over; None for a full checkpoint."""
    if not _has_key(path, "meta.base"):
        return None
    box: dict[str, Any] = {"meta": {"base": ""}}
    _dcp_load(box, path, dp)
    return str(box["meta"]["base"])


def _check_base(path: Path, dp: DataParallel, config: Config | None, key: str) -> None:
    """An adapter-only checkpoint fits only the base weights its adapters were trained over."""
    saved = saved_base(path, dp)
    if saved is None or config is None or saved == base_source(config):
        return
    raise CheckpointError(f"{key}={path}: its adapters were trained over {saved}, this run's base weights are "
                          f"{base_source(config)}; set {saved} (an adapter-only checkpoint holds no base weights)")


# --------------------------------------------------------------------------
# what is saved


@dataclass
class TrainingState:
    """The objects whose state a checkpoint holds."""

    model: nn.Module
    optimizer: AdamW
    data: Any  # MicroBatchIterator
    valid: Any = None
    device: torch.device = torch.device("cpu")
    base: str | None = None  # base_source(config): recorded in an adapter-only checkpoint (Checkpointer sets it)

    def __post_init__(self) -> None:
        self._layout = LayoutEntries()

    def model_state(self) -> dict[str, torch.Tensor]:
        """The model's entries (any layout loads them: :class:`LayoutEntries`)."""
        return self._layout.model(self.model)

    def finish_load(self) -> None:
        """After ``dcp.load`` filled a state dict of this object: the fused tensor-parallel shards, in place."""
        self._layout.finish_load()

    def finish_save(self) -> None:
        """After ``dcp.save``: drop the gathered copies the state dict held."""
        self._layout = LayoutEntries()

    def _optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """``master``, ``exp_avg``, ``exp_avg_sq`` by parameter name, each shaped like its parameter."""
        opt = self.optimizer
        params = opt.grads.params  # the model's parameters (DTensors when sharded)
        names = {id(p): n for n, p in self.model.named_parameters()}
        parts = {id(p): fused_parts(m) for m in self.model.modules() for p in m.parameters(recurse=False)}
        return {kind: {names[id(p)]: self._layout.entry(t, p, parts.get(id(p))) for p, t in zip(params, tensors)}
                for kind, tensors in (("master", opt.master), ("exp_avg", opt.exp_avg),
                                      ("exp_avg_sq", opt.exp_avg_sq))}

    def master_weight_keys(self) -> list[str]:
        """The model entries of the parameters that are their own fp32 master weights (fp32 parameters, FSDP2's
        fp32 shards): the same tensor as their ``optimizer.master`` entry."""
        opt = self.optimizer
        names = {id(p): n for n, p in self.model.named_parameters()}
        return [names[id(p)] for p, local, master in zip(opt.grads.params, opt.model_params, opt.master)
                if master.data_ptr() == local.data_ptr()]

    def state_dict(self, iteration: int, dp: DataParallel) -> dict[str, Any]:
        """The DCP state dict: live tensors (saved as they are, loaded into in place) and host values."""
        opt = self.optimizer
        sched = opt.schedule
        self._layout = LayoutEntries()
        state: dict[str, Any] = {
            "iteration": iteration,
            "model": self.model_state(),
            "optimizer": {"step": opt.step_t, **self._optimizer_state()},
            "scheduler": {"max_lr": sched.max_lr, "min_lr": sched.min_lr, "warmup_iters": sched.warmup_iters,
                          "decay_iters": sched.decay_iters, "style": sched.style},
            "rng": {f"rank{dp.rank}": _rng_state(self.device)},
            "data": {"train": self.data.state_dict()},
            "meta": {"world_size": dp.world_size, "layout": _layout(dp)},
        }
        if adapter_keys(self.model) is not None:  # adapter-only: the base it was trained over
            state["meta"]["base"] = self.base or "unknown"
        if self.valid is not None:
            state["data"]["valid"] = self.valid.state_dict()
        return state


def _layout(dp: DataParallel) -> dict[str, int]:
    return {"pp": dp.layout.pp, "dp": dp.dp_size, "cp": dp.layout.cp, "tp": dp.layout.tp}


def rng_source_rank(saved: dict[str, int] | None, saved_world: int, dp: DataParallel) -> int | None:
    """The saved rank whose RNG streams this rank continues (None: keep this run's seeded streams).

    ``saved``: the checkpoint's ``meta.layout`` (None in a checkpoint saved before it was recorded: the own rank
    at the same world size, else rank 0, as those checkpoints were loaded). Ranks are in (pp, dp, cp, tp) order
    (``cp`` 1 in a checkpoint saved before it was recorded); a context-parallel rank the checkpoint did not have
    continues rank 0's streams of its other dimensions.
    """
    if saved is None:
        return dp.rank if saved_world == dp.world_size else 0
    if dp.pp_rank >= saved["pp"] or dp.tp_rank >= saved["tp"]:
        return None
    replica = dp.dp_rank if dp.dp_rank < saved["dp"] else 0
    cp = saved.get("cp", 1)
    cp_rank = dp.cp_rank if dp.cp_rank < cp else 0
    return ((dp.pp_rank * saved["dp"] + replica) * cp + cp_rank) * saved["tp"] + dp.tp_rank


def _rng_state(device: torch.device) -> dict[str, Any]:
    state: dict[str, Any] = {
        "tracker": get_rng_tracker().get_all_states(),
        "torch_cpu": torch.get_rng_state(),
        "python": random.getstate(),
    }
    if device.type == "cuda":
        state["torch_cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    get_rng_tracker().set_all_states(state["tracker"])
    torch.set_rng_state(state["torch_cpu"])
    random.setstate(state["python"])
    if device.type == "cuda" and "torch_cuda" in state:
        torch.cuda.set_rng_state(state["torch_cuda"], device)


# --------------------------------------------------------------------------
# saving


def save_checkpoint(root: str | Path, iteration: int, state: TrainingState, dp: DataParallel,
                    config: Config | None = None, *, before_rename: Callable[[int], None] | None = None) -> Path:
    """Write ``iter_<iteration>`` atomically (see the module docstring); every rank calls it.

    ``before_rename(iteration)`` runs once this rank's files are written, before the rename (tests kill here).
    """
    root = Path(root)
    final = root / iter_dir_name(iteration)
    tmp = root / dp.broadcast_object(f"{final.name}.tmp-{secrets.token_hex(3)}" if dp.is_main else None)
    if dp.is_main:
        tmp.mkdir(parents=True, exist_ok=False)
    dp.barrier()
    with _single_process_quiet():
        dcp.save(state.state_dict(iteration, dp), checkpoint_id=tmp, process_group=dp.control)
    state.finish_save()
    if dp.is_main and config is not None:
        save_yaml(config, tmp / "config.yaml")
    if before_rename is not None:
        before_rename(iteration)
    dp.barrier()  # every rank's files are written
    if dp.is_main:
        _publish(root, tmp, final, iteration)
    dp.barrier()  # nobody starts the next save (or exits) before the rename
    log.info("saved checkpoint %s", final)
    return final


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    # Without a process group DCP warns that it assumes a single process -- which is what we mean.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process.*")
        yield


def _publish(root: Path, tmp: Path, final: Path, iteration: int) -> None:
    old = None
    if final.exists():  # the same iteration saved again: keep the old one until the new one is in place
        old = final.with_name(f"{final.name}.old-{secrets.token_hex(3)}")
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(root)
    tracker_tmp = root / f".{TRACKER}.tmp-{secrets.token_hex(3)}"
    with open(tracker_tmp, "w") as fh:
        fh.write(f"{iteration}\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tracker_tmp, root / TRACKER)
    _fsync_dir(root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob("iter_*.tmp-*"):  # saves killed before their rename; never loadable
        m = re.match(r"^iter_(\d+)\.tmp-", stale.name)
        if m and int(m.group(1)) <= iteration:
            log.info("removing %s (an unfinished save)", stale)
            shutil.rmtree(stale, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# --------------------------------------------------------------------------
# loading


def load_checkpoint(path: Path, state: TrainingState, dp: DataParallel, *, finetune: bool = False,
                    config: Config | None = None) -> int:
    """Load ``path`` into ``state`` in place; returns the iteration to continue after (0 with finetune).

    First the model's parameter names and shapes are compared with the checkpoint's (every rank's together,
    as pipeline stages hold parts of the model): a checkpoint of another model is refused, naming the
    ``model.*`` field that differs when ``config`` (this run's) and the checkpoint's config.yaml say which.
    """
    check_model_matches(path, state.model, dp, config)
    _check_base(path, dp, config, "checkpoint.load")
    if finetune:  # weights only: a fresh optimizer, schedule, data order and iteration count
        template: dict[str, Any] = {"model": state.model_state()}
        _dcp_load(template, path, dp)
        state.finish_load()
        with torch.no_grad():
            for master, p in zip(state.optimizer.master, state.optimizer.model_params):
                if master.data_ptr() != p.data_ptr():
                    master.copy_(p)
        log.info("fine-tuning from %s: weights loaded, optimizer and iteration start fresh", path)
        return 0
    saved_world, saved_layout = _saved_meta(path, dp)
    template = state.state_dict(0, dp)
    rng_rank = rng_source_rank(saved_layout, saved_world, dp)
    if saved_world != dp.world_size or (saved_layout is not None and saved_layout != _layout(dp)):
        how = ("each rank takes the RNG streams of the rank that had its stage and tensor-parallel rank (or keeps "
               "its own seeded ones where the checkpoint has none)" if saved_layout is not None
               else "every rank takes rank 0's RNG streams")
        log.warning("resuming %s from a checkpoint of %s: %s and the data order continues, but the run is not "
                    "bit-identical to an uninterrupted one", _describe(_layout(dp), dp.world_size),
                    _describe(saved_layout, saved_world), how)
    if "base" in template["meta"] and not _has_key(path, "meta.base"):  # a full checkpoint into a run with adapters
        del template["meta"]["base"]
    # A parameter that is its own master weight is loaded from ``optimizer.master`` alone: a checkpoint of bf16
    # parameters holds them rounded under ``model.*``, and DCP, reading both into the same tensor in file order,
    # could let the rounded copy land last.
    for key in state.master_weight_keys():
        template["model"].pop(key, None)
    own_rng = template["rng"].pop(f"rank{dp.rank}")
    template["rng"] = {f"rank{rng_rank}": own_rng} if rng_rank is not None else {}
    if "valid" in template["data"] and not _has_key(path, "data.valid."):  # saved by a run without evaluation
        del template["data"]["valid"]
    _dcp_load(template, path, dp)
    state.finish_load()
    _check_schedule(template["scheduler"], state.optimizer, path)
    if rng_rank is not None:
        _set_rng_state(template["rng"][f"rank{rng_rank}"], state.device)
    state.data.load_state_dict(template["data"]["train"])
    if state.valid is not None and "valid" in template["data"]:
        state.valid.load_state_dict(template["data"]["valid"])
    iteration = int(template["iteration"])
    log.info("resumed from %s at iteration %d", path, iteration)
    return iteration


def _dcp_load(template: dict[str, Any], path: Path, dp: DataParallel) -> None:
    try:
        with _single_process_quiet():
            dcp.load(template, checkpoint_id=path, process_group=dp.control)
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        failures = getattr(exc, "failures", None)
        why = ("; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, (e, _trace) in failures.items())
               if failures else f"{type(exc).__name__}: {exc}")
        why = " ".join(why.split())  # one line: torch's size-mismatch messages span several
        if len(why) > 600:
            why = why[:600] + " ..."
        raise CheckpointError(f"cannot load checkpoint {path} into this run: {why} -- its files are intact, so it "
                              "was probably saved for another model shape or recipe") from exc


def _has_key(path: Path, prefix: str) -> bool:
    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    return any(k.startswith(prefix) for k in keys)


def _saved_meta(path: Path, dp: DataParallel) -> tuple[int, dict[str, int] | None]:
    """The checkpoint's world size and layout (None where it was saved without one; ``cp`` 1 where it was saved
    before context parallel was recorded)."""
    box: dict[str, Any] = {"meta": {"world_size": 0}}
    if _has_key(path, "meta.layout."):
        box["meta"]["layout"] = {"pp": 0, "dp": 0, "tp": 0, **({"cp": 0} if _has_key(path, "meta.layout.cp") else {})}
    _dcp_load(box, path, dp)
    layout = box["meta"].get("layout")
    return int(box["meta"]["world_size"]), ({"cp": 1, **{k: int(v) for k, v in layout.items()}}
                                            if layout is not None else None)


def _describe(layout: dict[str, int] | None, world: int) -> str:
    if layout is None:
        return f"{world} rank(s)"
    cp = f" x cp{layout['cp']}" if layout.get("cp", 1) > 1 else ""
    return f"{world} rank(s) (pp{layout['pp']} x dp{layout['dp']}{cp} x tp{layout['tp']})"


# The model fields that decide parameter names and shapes (a checkpoint of another value does not fit).
SHAPE_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                "kv_channels", "vocab_size", "share_embeddings_and_output_weights", "qk_layernorm", "add_qkv_bias",
                "num_moe_experts", "moe_layer_freq", "moe_ffn_hidden_size", "moe_router_enable_expert_bias",
                "moe_shared_expert_intermediate_size", "hybrid_override_pattern", "mamba_state_dim",
                "mamba_head_dim", "mamba_num_groups")


def saved_model_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """``{parameter or buffer name: global shape}`` of the model a checkpoint holds (from DCP's index)."""
    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    return {k[len("model."):]: tuple(v.size) for k, v in keys.items() if k.startswith("model.") and hasattr(v, "size")}


def check_model_matches(path: Path, model: nn.Module, dp: DataParallel, config: Config | None = None, *,
                        key: str = "checkpoint.load") -> None:
    """Raise ``CheckpointError`` when ``path`` holds another model than ``model`` (names or shapes differ).

    DCP loads the entries a state dict asks for and ignores the others, so without this a 4-layer
    checkpoint loads into a 2-layer model, its last layers dropped. Every rank calls it.
    """
    keep = adapter_keys(model)
    wanted: dict[str, tuple[int, ...]] = {}
    for part in dp.all_gather_object({k: tuple(t.shape) for k, t in model.state_dict().items()
                                      if keep is None or k in keep}):
        wanted.update(part)  # global shapes (DTensors report theirs); pipeline stages hold parts of the model
    saved = saved_model_shapes(path)
    if keep is None and _has_key(path, "meta.base"):
        raise CheckpointError(f"{key}={path} holds LoRA/DoRA adapters only (a checkpoint of a peft run), not a "
                              f"whole model; " + ("point it at the checkpoint of the base model (the adapters' run "
                                                  "names it as its checkpoint.pretrained_checkpoint)"
                                                  if key == "checkpoint.pretrained_checkpoint" else
                              "resume it with the peft.* fields and the base weights of the run that saved it"))
    frozen = set(model.state_dict()) if keep is not None else set()  # a full checkpoint holds them: not read
    extra = [k for k in saved if k not in wanted and k not in frozen]
    missing = [k for k in wanted if k not in saved]
    differ = [k for k in wanted if k in saved and saved[k] != wanted[k]]
    if not (extra or missing or differ):
        return
    fields = _differing_shape_fields(path, config)
    if fields:
        what = ", ".join(f"model.{f}={a} (this run: {b})" for f, (a, b) in fields.items())
        fix = ("set " + " ".join(f"model.{f}={a}" for f, (a, _) in fields.items())
               + f" to continue it, or point {key} at a checkpoint of this model")
    else:
        what = "; ".join(part for part in (
            _some("it holds", extra, "that this model lacks"), _some("it lacks", missing, "that this model has"),
            "; ".join(f"{k} is {list(saved[k])} there, {list(wanted[k])} here" for k in differ[:3])) if part)
        fix = f"give this run the model.* fields of the run that saved it, or point {key} elsewhere"
    raise CheckpointError(f"cannot load checkpoint {path} into this run: it was saved for another model: {what}; "
                          f"{fix}")


def load_pretrained(load: str | Path, model: nn.Module, dp: DataParallel, config: Config | None = None, *,
                    key: str = "checkpoint.pretrained_checkpoint") -> Path:
    """``checkpoint.pretrained_checkpoint``: the model weights of a graphstep checkpoint, loaded in place into the
    model as built -- before adapters, parallelism or the optimizer exist (training/build.py). Every rank loads
    the same folder: its newest intact checkpoint, or the ``iter_NNNNNNN`` folder named. ``key`` names the
    setting in errors (``graphstep export`` loads a checkpoint's weights here too: training/export.py)."""
    try:
        path = choose_checkpoint(load)
    except CheckpointError as exc:
        raise CheckpointError(str(exc).replace("checkpoint.load", key)) from exc
    if path is None:
        hf = (Path(load) / "config.json").is_file()
        raise CheckpointError(f"{key}={load} holds no complete graphstep checkpoint; " + (
            f"it is a Hugging Face model folder: set model.hf_path={load} instead" if hf else
            "name a checkpoint.save folder of a graphstep run (or one iter_NNNNNNN folder in it)"))
    check_model_matches(path, model, dp, config, key=key)
    layout = LayoutEntries()
    _dcp_load({"model": layout.model(model)}, path, dp)
    layout.finish_load()
    log.info("%s=%s: model weights loaded from %s", key, load, path)
    return path


def _some(lead: str, keys: list[str], tail: str) -> str:
    if not keys:
        return ""
    shown = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
    return f"{lead} {shown} {tail}"


def _differing_shape_fields(path: Path, config: Config | None) -> dict[str, tuple[Any, Any]]:
    """``{field: (saved value, this run's)}`` of ``SHAPE_FIELDS`` from the checkpoint's config.yaml (if any)."""
    if config is None:
        return {}
    try:
        saved = (yaml.safe_load((path / "config.yaml").read_text()) or {}).get("model") or {}
    except (OSError, ValueError, AttributeError, yaml.YAMLError):
        return {}
    return {f: (saved[f], getattr(config.model, f)) for f in SHAPE_FIELDS
            if f in saved and saved[f] != getattr(config.model, f)}


def saved_iteration(path: Path, dp: DataParallel) -> int:
    """The iteration a checkpoint was saved at (read alone, before the whole load)."""
    box: dict[str, Any] = {"iteration": 0}
    _dcp_load(box, path, dp)
    return int(box["iteration"])


def _check_schedule(saved: dict[str, Any], optimizer: AdamW, path: Path) -> None:
    s = optimizer.schedule
    now = {"max_lr": s.max_lr, "min_lr": s.min_lr, "warmup_iters": s.warmup_iters, "decay_iters": s.decay_iters,
           "style": s.style}
    changed = {k: (saved[k], now[k]) for k in now if saved.get(k) != now[k]}
    if changed:
        log.warning("the LR schedule differs from the one saved in %s (%s): the resumed run follows this run's "
                    "config", path, ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items()))


# --------------------------------------------------------------------------
# the trainer's view


class Checkpointer:
    """``checkpoint.*`` for the training loop: resume once, save every ``save_interval`` and at the end."""

    def __init__(self, cfg: CheckpointConfig, dp: DataParallel, state: TrainingState, config: Config, *,
                 before_rename: Callable[[int], None] | None = None) -> None:
        self.cfg, self.dp, self.state, self.config = cfg, dp, state, config
        self.before_rename = before_rename  # RunHooks.before_checkpoint_rename
        state.base = base_source(config)
        assert cfg.save_interval is None or cfg.save_interval >= 1, "rule V7 refuses checkpoint.save_interval < 1"
        self.last_saved: int | None = None

    def resume(self) -> int:
        """Load ``checkpoint.load`` if it holds a checkpoint; the iteration to continue after."""
        if not self.cfg.load:
            return 0
        path = self._choose()
        if path is None:
            log.warning("checkpoint.load=%s holds no complete checkpoint: training from the start", self.cfg.load)
            return 0
        iters = self.config.train.train_iters
        if not self.cfg.finetune and (saved := saved_iteration(path, self.dp)) >= iters:
            raise CheckpointError(f"checkpoint.load={self.cfg.load}: {path.name} is at iteration {saved} and "
                                  f"train.train_iters={iters}, so nothing is left to train; raise "
                                  f"train.train_iters above {saved} to continue the run (or set "
                                  "checkpoint.finetune=true to start a new one from its weights)")
        iteration = load_checkpoint(path, self.state, self.dp, finetune=self.cfg.finetune, config=self.config)
        self.last_saved = iteration  # nothing to save again before the next iteration
        return iteration

    def _choose(self) -> Path | None:
        # Rank 0 verifies and chooses, so that every rank loads the same folder (or fails the same way).
        choice: tuple[str, str | None] = ("ok", None)
        if self.dp.is_main:
            try:
                path = choose_checkpoint(self.cfg.load)
                choice = ("ok", str(path) if path is not None else None)
            except CheckpointError as exc:
                choice = ("error", str(exc))
        kind, value = self.dp.broadcast_object(choice)
        if kind == "error":
            raise CheckpointError(value)
        return Path(value) if value is not None else None

    def after_iteration(self, iteration: int, *, last: bool) -> None:
        """Save when ``iteration`` is due (every ``save_interval``, and the last one)."""
        if not self.cfg.save or iteration == self.last_saved:
            return
        interval = self.cfg.save_interval
        if last or (interval and iteration % interval == 0):
            save_checkpoint(self.cfg.save, iteration, self.state, self.dp, self.config if self.dp.is_main else None,
                            before_rename=self.before_rename)
            self.last_saved = iteration
