"""What the layout tests compare of a training run, and of its checkpoints."""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path
from typing import Iterator

import torch


def shard_digest(model: torch.nn.Module) -> str:
    """This rank's part of every parameter (the local tensor of a DTensor)."""
    from graphstep.parallel.dims import local_tensor

    h = hashlib.sha256()
    for p in model.parameters():
        h.update(local_tensor(p).detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def train_report(result) -> dict:
    """What a layout test compares of a training run: losses, states, evaluation losses, this rank's weights."""
    return {"losses": [r["loss"] for r in result.rows], "states": [r["state"] for r in result.rows],
            "eval": result.eval_losses, "shard": shard_digest(result.model), "graphs": result.graphs}


@contextlib.contextmanager
def core_attention_calls() -> Iterator[list[int]]:
    """Counts the training calls of the attention's core (models/transformer.py ``Attention.core_attention``) while
    the block runs: a recomputed one (selective ``core_attn`` or full recompute) is called again in the backward.
    A replayed graph calls nothing."""
    from graphstep.models.transformer import Attention

    real, calls = Attention.core_attention, [0]

    def counted(self, *args, **kwargs):
        calls[0] += self.training
        return real(self, *args, **kwargs)

    Attention.core_attention = counted
    try:
        yield calls
    finally:
        Attention.core_attention = real


def graphed_states(iters: int, warmup: int = 1) -> list[str]:
    """A graphed run's states, iteration by iteration: ``warmup`` eager iterations, the capture, then replays."""
    return ["eager"] * warmup + ["captured"] + ["replayed"] * (iters - warmup - 1)


def assert_graphed_equals_eager(reports: list[dict], layouts: dict) -> None:
    """Every rank's graphed run of each layout: the eager run's losses and weights, bit for bit."""
    for layout in layouts:
        for report in reports:
            assert report[f"{layout}/graphed"]["losses"] == report[f"{layout}/eager"]["losses"], layout
            assert report[f"{layout}/graphed"]["shard"] == report[f"{layout}/eager"]["shard"], layout


def natural_digests(model: torch.nn.Module) -> dict[str, str]:
    """Each parameter this rank's model holds, in its natural layout (gathered when sharded), hashed by name."""
    from graphstep.training.checkpoint import LayoutEntries

    out = {}
    for key, t in sorted(LayoutEntries().model(model).items()):
        whole = t.full_tensor() if hasattr(t, "full_tensor") else t
        out[key] = hashlib.sha256(whole.detach().float().contiguous().numpy().tobytes()).hexdigest()
    return out


def whole_model_digests(reports: list[dict], layout: str) -> dict[str, str]:
    """The union of the ranks' parameters (pipeline stages hold different ones); ranks holding one agree."""
    merged: dict[str, str] = {}
    for report in reports:
        for key, digest in report[layout]["digest"].items():
            assert merged.setdefault(key, digest) == digest, key
    return merged


def load_weights(cfg) -> torch.nn.Module:
    """One process's model of ``cfg`` holding the weights of ``cfg.checkpoint.load`` (a final checkpoint: a
    resume from it would have nothing left to train, which the trainer refuses)."""
    from graphstep.training.build import RunOptions, build_run
    from graphstep.training.checkpoint import TrainingState, load_checkpoint
    from graphstep.training.distributed import DataParallel

    def restore(model: torch.nn.Module, optimizer) -> int:
        return load_checkpoint(Path(cfg.checkpoint.load), TrainingState(model, optimizer, data=None), DataParallel(),
                               finetune=True, config=cfg)

    run = build_run(cfg, RunOptions(torch.device("cpu"), restore=restore))
    run.close()
    return run.model
