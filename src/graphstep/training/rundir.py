"""Before iteration 1: every output path is writable, and no other run writes there.

Two checks that turn a late, lossy failure into an immediate one-line error
(``RunSetupError``, which the command line reports with exit code 2):

* ``check_outputs_writable(cfg)`` -- ``checkpoint.save``,
  ``logger.metrics_path``, ``logger.tensorboard_dir`` and (with a
  ``logger.wandb_project``) ``logger.wandb_save_dir`` are created as the run
  would create them, and a probe file is written and removed in each
  directory (an existing metrics file is opened for appending, which changes
  nothing). A path that is a file, a directory under a file, a read-only
  mount, a pseudo file system such as ``/proc`` or missing permissions are
  found here, not at the first save after hours of training (nor as a
  traceback from TensorBoard or W&B once the run is built).
* ``RunLock`` -- each output directory gets ``.graphstep.lock`` holding the
  owner's pid, host and start time, locked with ``fcntl.flock``. A second
  run on the same directory is refused with the first one's pid and host.
  The kernel drops the flock when the owner dies (even by SIGKILL), so a
  lock file whose flock can be taken is stale: it is taken over with a
  warning. The lock file is removed on normal exit, on exceptions and after
  SIGTERM (the loop stops cleanly and its ``finally`` releases the lock).
  On a file system without working ``flock`` the file's pid is checked
  instead (a live pid on this host, or any pid on another host, refuses).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

from ..config import Config
from ..errors import RunSetupError

log = logging.getLogger("graphstep")

LOCK_NAME = ".graphstep.lock"


# --------------------------------------------------------------------------
# writable outputs


def output_dirs(cfg: Config) -> list[tuple[str, Path]]:
    """``(field, directory)`` for every directory the run writes into (rank 0's view)."""
    dirs: list[tuple[str, Path]] = []
    if cfg.checkpoint.save:
        dirs.append(("checkpoint.save", Path(cfg.checkpoint.save)))
    if cfg.logger.metrics_path:
        dirs.append(("logger.metrics_path", Path(cfg.logger.metrics_path).parent))
    return dirs


def check_outputs_writable(cfg: Config, *, metrics: bool = True) -> None:
    """Raise ``RunSetupError`` naming the field when an output path cannot be written.

    ``metrics``: also the outputs only the main rank writes (metrics file, TensorBoard, W&B).
    """
    if cfg.checkpoint.save:
        _check_dir("checkpoint.save", Path(cfg.checkpoint.save))
    if not metrics:
        return
    lg = cfg.logger
    if lg.tensorboard_dir:
        _check_dir("logger.tensorboard_dir", Path(lg.tensorboard_dir))
    if lg.wandb_project and lg.wandb_save_dir:  # without a project nothing is written there
        _check_dir("logger.wandb_save_dir", Path(lg.wandb_save_dir))
    if cfg.logger.metrics_path:
        path = Path(cfg.logger.metrics_path)
        if path.is_dir():
            raise RunSetupError(f"logger.metrics_path={path} is a directory; name a file such as {path / 'metrics.jsonl'}")
        _check_dir("logger.metrics_path", path.parent, shown=path)
        if path.exists():
            try:
                with open(path, "a"):
                    pass
            except OSError as exc:
                raise RunSetupError(f"logger.metrics_path={path}: cannot write to this file ({_why(exc)}); "
                                    "choose another path or fix its permissions") from None


def _check_dir(field: str, directory: Path, *, shown: Path | None = None) -> None:
    shown = shown or directory
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe_directory(directory)
    except OSError as exc:
        raise RunSetupError(f"{field}={shown}: cannot write in {directory} ({_why(exc, directory)}); "
                            f"choose another path for {field}") from None


def probe_directory(directory: Path) -> None:
    """Create and remove a small file in ``directory`` (raises ``OSError`` when that fails)."""
    probe = directory / f".graphstep-probe-{os.getpid()}"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, b"probe\n")
    finally:
        os.close(fd)
        try:
            os.unlink(probe)
        except FileNotFoundError:
            pass


def _why(exc: OSError, directory: Path | None = None) -> str:
    if isinstance(exc, (NotADirectoryError, FileExistsError)) or exc.errno in (errno.ENOTDIR, errno.EEXIST):
        return f"{_blocking_file(directory) or exc.filename or 'a part of the path'} is a file, not a directory"
    if isinstance(exc, PermissionError) or exc.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    if exc.errno == errno.EROFS:
        return "read-only file system"
    if exc.errno == errno.ENOSPC:
        return "no space left on the device"
    if exc.errno == errno.ENOENT:  # e.g. a folder under /proc, which takes no new entries
        return "it cannot be created there: no such file or directory"
    return exc.strerror or type(exc).__name__


def _blocking_file(directory: Path | None) -> Path | None:
    """The first part of ``directory`` that exists and is not a directory (None if none)."""
    if directory is None:
        return None
    for part in [*reversed(directory.parents), directory]:
        if part.exists() and not part.is_dir():
            return part
    return None


# --------------------------------------------------------------------------
# the run lock


def _owner() -> dict[str, Any]:
    return {"pid": os.getpid(), "host": socket.gethostname(), "start": _start_ticks(os.getpid()),
            "since": time.strftime("%Y-%m-%d %H:%M:%S")}


def _start_ticks(pid: int) -> int | None:
    """The process's start time (clock ticks since boot): tells a live owner from a reused pid."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _alive(owner: dict[str, Any]) -> bool:
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    start = owner.get("start")
    return start is None or _start_ticks(pid) in (None, start)


def _describe(owner: dict[str, Any]) -> str:
    return f"pid {owner.get('pid', '?')} on {owner.get('host', '?')}, since {owner.get('since', '?')}"


class RunLock:
    """Exclusive use of output directories by this process; a context manager."""

    def __init__(self, directories: list[Path]) -> None:
        unique: dict[str, Path] = {}
        for d in directories:
            unique.setdefault(os.path.realpath(d), Path(d))
        self.directories = list(unique.values())
        self._held: list[tuple[Path, int]] = []

    def __enter__(self) -> "RunLock":
        try:
            for d in self.directories:
                self._held.append((d / LOCK_NAME, _acquire(d / LOCK_NAME)))
        except BaseException:
            self.release()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def release(self) -> None:
        while self._held:
            path, fd = self._held.pop()
            try:
                if _same_file(fd, path):
                    os.unlink(path)  # before the unlock: nobody can lock a file we are about to remove
            except OSError:
                pass
            os.close(fd)  # drops the flock


def _acquire(path: Path) -> int:
    for _ in range(10):  # a lock file removed between our open and our flock: open the new one
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            flocked = _try_flock(fd)
            previous = _read_owner(fd)
            if not flocked:
                raise RunSetupError(_held_message(path, previous))
            if not _same_file(fd, path):
                os.close(fd)
                continue
            if previous and previous.get("pid") != os.getpid():
                if flocked == "unsupported" and (previous.get("host") != socket.gethostname() or _alive(previous)):
                    raise RunSetupError(_held_message(path, previous))
                log.warning("taking over the stale lock %s of a run that is no longer running (%s)",
                            path, _describe(previous))
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(_owner()) + "\n").encode(), 0)
            return fd
        except BaseException:
            os.close(fd)
            raise
    raise RunSetupError(f"cannot take the run lock {path}: it keeps changing; is another run starting there?")


def _try_flock(fd: int) -> bool | str:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            return "unsupported"  # the pid in the file decides
        raise


def _read_owner(fd: int) -> dict[str, Any]:
    for _ in range(20):  # the owner writes right after its flock: wait a moment for its line
        raw = os.pread(fd, 4096, 0)
        if raw.strip():
            try:
                owner = json.loads(raw.decode())
                return owner if isinstance(owner, dict) else {}
            except (ValueError, UnicodeDecodeError):
                return {}
        time.sleep(0.01)
    return {}


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _held_message(path: Path, owner: dict[str, Any]) -> str:
    return (f"another graphstep run ({_describe(owner)}) is writing to {path.parent} (lock {path}); "
            "wait for it to finish, stop it, or give this run other output paths")
