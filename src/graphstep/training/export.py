"""``graphstep export``: a trained run's model written for Hugging Face -- merged (``--format hf``) or, for a
LoRA/DoRA run, its adapters in HF peft's format (``--format peft``).

    graphstep export runs/ft --format peft --out ft-adapter      # adapter_config.json + adapter_model.safetensors
    graphstep export runs/ft/iter_0000200 --format hf --out ft-hf  # config.json + model.safetensors, adapters merged

What is exported is the model of one checkpoint, rebuilt as its run built it (:func:`export_checkpoint`):

1. the checkpoint: the newest intact one of a ``checkpoint.save`` folder (the one ``checkpoint.load`` would
   resume), or the ``iter_NNNNNNN`` folder named;
2. the config saved beside it (``config.yaml``): the model's shape, dtype and ``peft.*`` fields;
3. the model, built on the CPU in the checkpoint's dtype (DCP's index says which). A full checkpoint holds every
   weight and is loaded as is. An adapter-only checkpoint (a ``peft`` run, training/checkpoint.py) holds the
   adapters only, and ``meta.base`` records where the frozen base came from: the base weights are loaded from
   there (a graphstep checkpoint, a Hugging Face folder -- ``--base DIR`` when it has moved since -- or the
   run's seed), the adapters added and loaded over them. ``peft.adapter_path`` is not read again: the
   checkpoint's adapters are the trained ones;
4. ``models/hf.py`` writes the format: ``export_hf`` (every adapter folded into its base weight) or
   ``export_peft_adapter`` (its ``base_model_name_or_path`` is the base's Hugging Face folder when it came from
   one).

FP8 (``mixed_precision.fp8``) is a compute format: the checkpoint's weights are the high-precision ones, and
they are what is exported. Every failure is one line (``HFExportError``, ``CheckpointError``): no checkpoint, a
folder without ``config.yaml``, an ``--out`` folder that is not new or empty, ``--format peft`` for a run
without adapters, a base that is not where ``meta.base`` says.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from ..config import Config
from ..config_files import load_yaml
from ..converters import lora
from ..cuda_graph.rng import initialize_rng_tracker
from ..errors import CheckpointError, HFExportError
from ..models import build_model
from ..models.hf import export_hf, export_peft_adapter, load_hf_weights
from .checkpoint import choose_checkpoint, load_pretrained, saved_base
from .distributed import DataParallel

log = logging.getLogger("graphstep")

FORMATS = ("hf", "peft")
_BASE_FIELDS = ("checkpoint.pretrained_checkpoint", "model.hf_path", "rng.seed")


def export_checkpoint(source: str | Path, fmt: str, out: str | Path, *, base: str | Path | None = None) -> Path:
    """Write the model of the checkpoint ``source`` names (a ``checkpoint.save`` folder or one ``iter_*`` folder)
    to the new or empty folder ``out`` in ``fmt`` (``hf`` or ``peft``); ``base`` replaces the base weights' folder
    an adapter-only checkpoint records. Returns ``out``."""
    out = Path(out)
    if fmt not in FORMATS:
        raise HFExportError(f"--format {fmt}: not an export format; use --format hf (the merged model) or "
                            "--format peft (a LoRA/DoRA run's adapters)")
    _check_out(out)
    path = _checkpoint_of(source)
    cfg = _config_of(path)
    dp = DataParallel()
    recorded = saved_base(path, dp)  # None: a full checkpoint
    if fmt == "peft" and (recorded is None or cfg.peft.scheme is None):
        raise HFExportError(f"{path} is the checkpoint of a run without LoRA/DoRA adapters (peft is null): it has "
                            "no adapters to write in peft's format; export the whole model with --format hf")
    if base is not None and recorded is None:
        raise HFExportError(f"--base {base}: {path} holds the whole model (not an adapter-only checkpoint), so it "
                            "takes no base weights; drop --base")
    model = _rebuild(cfg, path, recorded, base, dp)
    model.eval()
    if fmt == "peft":
        hf_base = cfg.model.hf_path
        written = export_peft_adapter(model, cfg.model, out,
                                      base_model_name_or_path=str(hf_base) if hf_base else None)
    else:
        written = export_hf(model, cfg.model, out)
    log.info("exported %s (iteration folder %s) as --format %s to %s", source, path.name, fmt, written)
    return written


def _check_out(out: Path) -> None:
    """Before any work: ``--out`` is a new or empty folder (the writers check again, this says it first)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        what = "is a file" if not out.is_dir() else "is not empty"
        raise HFExportError(f"--out {out} {what}; name a new or empty folder (an export never overwrites)")


def _checkpoint_of(source: str | Path) -> Path:
    """The intact checkpoint of ``source``, as ``checkpoint.load`` would choose it."""
    try:
        path = choose_checkpoint(source)
    except CheckpointError as exc:
        message = str(exc).replace(", or set checkpoint.load=null to train from the start", "")
        raise CheckpointError(message.replace("checkpoint.load=", "export ")) from None
    if path is None:
        raise CheckpointError(f"{source}: holds no complete graphstep checkpoint; name a run's "
                              "checkpoint.save folder (its newest intact checkpoint is exported) or one "
                              "iter_NNNNNNN folder in it")
    return path


def _config_of(path: Path) -> Config:
    config = path / "config.yaml"
    if not config.is_file():
        raise CheckpointError(f"{path}: no config.yaml beside the checkpoint (graphstep train saves the run's "
                              "config there), so the model it holds cannot be rebuilt; export a checkpoint saved "
                              "by graphstep train")
    return load_yaml(config)


def _rebuild(cfg: Config, path: Path, recorded: str | None, base: str | Path | None, dp: DataParallel) -> nn.Module:
    """The run's model with the checkpoint's weights, on the CPU (module docstring, step 3)."""
    cpu = torch.device("cpu")
    cfg.peft.adapter_path = None  # the checkpoint holds the trained adapters
    if recorded is not None:
        _point_at_base(cfg, path, recorded, base)
    # Initialised as the run did (from the seed, in fp32 on the CPU, then cast): the base of a run that
    # started from its seed is these weights exactly.
    initialize_rng_tracker(cfg.rng.seed, cpu, graph_safe=bool(cfg.model.use_te_rng_tracker),
                           data_parallel_random_init=bool(cfg.rng.data_parallel_random_init))
    model = build_model(cfg.model, cpu, dtype=_saved_dtype(path))
    if recorded is not None:  # adapter-only: the base first, frozen, then the adapters over it
        if cfg.model.hf_path:
            load_hf_weights(model, cfg.model.hf_path, cfg.model)
        elif cfg.checkpoint.pretrained_checkpoint:
            load_pretrained(cfg.checkpoint.pretrained_checkpoint, model, dp, cfg)
        plan = lora.plan_from(cfg.peft)
        if plan is None:
            raise CheckpointError(f"{path} holds LoRA/DoRA adapters only, but its config.yaml has peft=null; its "
                                  "config.yaml is not the one of the run that saved it")
        lora.apply_lora(model, plan)
    load_pretrained(path, model, dp, cfg, key="graphstep export")
    return model


def _point_at_base(cfg: Config, path: Path, recorded: str, base: str | Path | None) -> None:
    """Set the config's base field from the checkpoint's ``meta.base`` (or ``--base``); a base that is not there
    is an error naming both."""
    field, _, value = recorded.partition("=")
    if field not in _BASE_FIELDS:
        raise CheckpointError(f"{path}: meta.base={recorded!r} names no base graphstep knows ({', '.join(_BASE_FIELDS)})"
                              "; export a checkpoint saved by graphstep train")
    if field == "rng.seed":
        if base is not None:
            raise HFExportError(f"--base {base}: the adapters of {path} were trained over a base initialised from "
                                f"{recorded}, not over saved weights; drop --base")
        cfg.rng.seed = int(value)
        return
    where = Path(base) if base is not None else Path(value)
    if not where.exists():
        how = "--base" if base is not None else f"meta.base of {path.name}"
        raise CheckpointError(f"the adapters of {path} were trained over the base weights {field}={value}, and "
                              f"{where} ({how}) is not there; pass --base DIR naming the folder those weights are "
                              "in now")
    cfg.checkpoint.pretrained_checkpoint, cfg.model.hf_path = None, None
    if field == "model.hf_path":
        cfg.model.hf_path = str(where)
    else:
        cfg.checkpoint.pretrained_checkpoint = str(where)


def _saved_dtype(path: Path) -> torch.dtype:
    """The dtype of the checkpoint's model weights (the model's parameter dtype as trained; fp32 for FSDP2)."""
    entries = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for key, meta in entries.items():
        dtype = getattr(getattr(meta, "properties", None), "dtype", None)
        if key.startswith("model.") and dtype is not None and dtype.is_floating_point:
            return dtype
    raise CheckpointError(f"{path}: the checkpoint holds no model weights; export a checkpoint of a training run")
