"""Which checkpoint to resume from: found through the tracker, verified before anything is loaded.

Verification: which checkpoint to resume from, verified before anything is
loaded. A checkpoint folder is *intact* when its ``.metadata`` (DCP's index)
unpickles and every file that the index names is present and at least as
long as the byte ranges it records (DCP stores, for each tensor and object,
the file, the offset and the length). That finds a truncated or missing
``__0_0.distcp`` and a garbage or missing ``.metadata`` -- what a full disk,
an interrupted copy or a lost file leave behind -- in milliseconds, without
reading the data. (A bit flip inside a file keeps the sizes; DCP's load
then fails on it and says so.)

``choose_checkpoint(load)``:

* ``load`` names one ``iter_NNNNNNN`` folder: it is used if intact, else
  refused (``CheckpointError``, exit 2) with the list of intact ones beside it
  -- also when it does not exist (a typo must not restart the run);
* ``load`` names a file (a ``.pt``, a ``model.safetensors``, a file inside a
  checkpoint folder): refused, naming what ``checkpoint.load`` takes;
* ``load`` is a save directory: the tracker's iteration, else the newest
  ``iter_*`` folder; a damaged one is skipped with a warning naming the
  damaged file, and the newest intact one is taken; when every checkpoint is
  damaged the run is refused (starting over would overwrite them);
* no checkpoint at all: ``None`` (the trainer starts from iteration 0).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch.distributed.checkpoint as dcp

from ..errors import CheckpointError

log = logging.getLogger("graphstep")

TRACKER = "latest_checkpointed_iteration.txt"
ITER_DIR = re.compile(r"^iter_(\d{7,})$")


def iter_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


# --------------------------------------------------------------------------
# finding a checkpoint


def find_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint to resume from in ``root``: the tracker's, else the newest complete ``iter_*``."""
    root = Path(root)
    if _is_complete(root):  # checkpoint.load may name an iter_* folder itself
        return root
    if not root.is_dir():
        return None
    try:
        iteration = int((root / TRACKER).read_text().strip())
        chosen = root / iter_dir_name(iteration)
        if _is_complete(chosen):
            return chosen
        log.warning("%s names iteration %d but %s is not a complete checkpoint; using the newest complete one",
                    root / TRACKER, iteration, chosen.name)
    except (OSError, ValueError):
        pass
    complete = sorted((int(m.group(1)), p) for p in root.iterdir()
                      if (m := ITER_DIR.match(p.name)) and _is_complete(p))
    return complete[-1][1] if complete else None


def _is_complete(path: Path) -> bool:
    return bool(ITER_DIR.match(path.name)) and (path / ".metadata").is_file()


# --------------------------------------------------------------------------
# verifying a checkpoint before loading


def verify_checkpoint(path: Path) -> str | None:
    """What is wrong with the checkpoint folder ``path`` (one short phrase), or None when it is intact."""
    meta_file = path / ".metadata"
    if not meta_file.is_file():
        return f"{meta_file} is missing"
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as exc:  # unpickling garbage raises anything
        return f"{meta_file} is unreadable ({type(exc).__name__})"
    needed: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    if not needed:
        return f"{meta_file} names no data files"
    for name, size in sorted(needed.items()):
        f = path / name
        try:
            actual = f.stat().st_size
        except FileNotFoundError:
            return f"{f} is missing"
        except OSError as exc:
            return f"{f} cannot be read ({exc.strerror})"
        if actual < size:
            return f"{f} is truncated ({actual} of {size} bytes)"
    return None


def _iteration_dirs(root: Path) -> list[tuple[int, Path]]:
    return sorted(((int(m.group(1)), p) for p in root.iterdir() if (m := ITER_DIR.match(p.name)) and p.is_dir()),
                  reverse=True)


def _tracker_iteration(root: Path) -> int | None:
    try:
        return int((root / TRACKER).read_text().strip())
    except (OSError, ValueError):
        return None


def intact_checkpoints(root: Path) -> list[Path]:
    """The intact ``iter_*`` folders of ``root``, newest first."""
    return [p for _, p in _iteration_dirs(root) if verify_checkpoint(p) is None] if root.is_dir() else []


def choose_checkpoint(load: str | Path) -> Path | None:
    """The intact checkpoint to resume from (see the module docstring)."""
    root = Path(load)
    if root.exists() and not root.is_dir():
        raise CheckpointError(_not_a_folder(root))
    if ITER_DIR.match(root.name):
        return _exact(root)
    if not root.is_dir():
        return None
    candidates = _iteration_dirs(root)
    tracked = _tracker_iteration(root)
    candidates.sort(key=lambda ip: (ip[0] != tracked, -ip[0]))  # the tracker's first, then newest first
    damaged: list[str] = []
    for _, path in candidates:
        problem = verify_checkpoint(path)
        if problem is None:
            if damaged:
                log.warning("resuming from %s, the newest intact checkpoint (skipped: %s)", path, "; ".join(damaged))
            return path
        log.warning("checkpoint %s is damaged: %s", path, problem)
        damaged.append(f"{path.name}: {problem}")
    if damaged:
        raise CheckpointError(f"checkpoint.load={load}: every checkpoint there is damaged ({'; '.join(damaged)}); "
                              "restore one, or set checkpoint.load=null to train from the start")
    return None


def _not_a_folder(path: Path) -> str:
    where = next((p for p in path.parents if ITER_DIR.match(p.name)), None)
    if where is not None:
        hint = f"it is inside the checkpoint {where}: set checkpoint.load={where}"
    elif (path.parent / TRACKER).is_file() or _iteration_dirs(path.parent):
        hint = f"it is inside the checkpoint folder {path.parent}: set checkpoint.load={path.parent}"
    elif path.suffix == ".safetensors" or (path.parent / "config.json").is_file():
        hint = f"Hugging Face weights are read from a folder with model.hf_path={path.parent}"
    else:
        hint = ("name a checkpoint.save folder (its newest intact checkpoint is loaded) or one iter_NNNNNNN folder "
                "in it")
    return f"checkpoint.load={path} is a file, not a checkpoint folder; {hint}"


def _exact(path: Path) -> Path:
    if not path.is_dir():
        intact = intact_checkpoints(path.parent)
        others = ", ".join(str(p) for p in intact) if intact else "none"
        raise CheckpointError(f"checkpoint.load={path}: no such checkpoint folder; intact checkpoints in "
                              f"{path.parent}: {others} (name one, or checkpoint.load={path.parent} to take the "
                              "newest)")
    problem = verify_checkpoint(path)
    if problem is None:
        return path
    intact = intact_checkpoints(path.parent)
    others = ", ".join(str(p) for p in intact) if intact else "none"
    raise CheckpointError(f"checkpoint.load={path} is damaged: {problem}; intact checkpoints: {others} "
                          f"(name one, or checkpoint.load={path.parent} to take the newest intact one)")
