"""The peers' wheels: megatron-core and torchtitan are not dependencies of graphstep.

A peer row imports its library from a wheel file: ``$<ENV>`` or the newest
``vendor/<dist>-*.whl`` of the repository or of the working directory (the
``scripts/fetch-*`` scripts download them on a machine with network), or the
wheel of one version when the row names it (``megatron_full_cuda_graph@0.16.1``).
A wheel is unpacked once into the temporary directory. Every reason a wheel
cannot be used is a one-line ``RuntimeError``.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def vendor_dirs() -> list[Path]:
    """Where wheels are looked for: ``vendor/`` of the repository, then of the working directory."""
    dirs = [Path(__file__).resolve().parents[3] / "vendor", Path.cwd() / "vendor"]
    return list(dict.fromkeys(d.resolve() for d in dirs))


def wheel_version(wheel: Path) -> str:
    """``megatron_core-0.16.1-cp312-...whl`` -> ``0.16.1``."""
    parts = wheel.name[: -len(".whl")].split("-")
    return parts[1] if len(parts) > 1 else ""


def _version_key(wheel: Path) -> tuple[tuple[int, ...], int]:
    """(version numbers, 1 if the wheel's tag fits this interpreter)."""
    parts = wheel.name[: -len(".whl")].split("-")
    version = tuple(int(n) for n in re.findall(r"\d+", wheel_version(wheel)))
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    fits = int(tag in parts[2:3] or "py3" in parts[2:3])
    return version, fits


def find_wheel(dist: str, env: str, fetch: str, version: str | None = None) -> Path:
    """The wheel of ``dist`` (file name prefix, e.g. ``megatron_core``) to use: ``$env``, else the newest in
    vendor/ (of ``version`` when given); RuntimeError naming where it looked and ``fetch`` (how to get one)."""
    name = dist.replace("_", "-")
    path = os.environ.get(env)
    if path and version is None:
        wheel = Path(path).expanduser()
        if not wheel.is_file():
            raise RuntimeError(f"{name} wheel not found: {wheel} (from ${env})")
        return wheel
    pattern = f"{dist}-{version}-*.whl" if version else f"{dist}-*.whl"
    wheels = [w for d in vendor_dirs() if d.is_dir() for w in d.glob(pattern) if w.is_file()]
    if not wheels:
        where = ", ".join(str(d) for d in vendor_dirs())
        raise RuntimeError(f"{name} wheel not found: no {pattern} in {where} ({fetch}"
                           + ("" if version else f", or set ${env}") + ")")
    return max(wheels, key=_version_key)


def extract_wheel(wheel: Path) -> Path:
    """Unpack ``wheel`` once into the temporary directory; returns the directory to put on sys.path."""
    size = wheel.stat().st_size
    dest = Path(tempfile.gettempdir()) / "graphstep-wheels" / f"{wheel.name[:-len('.whl')]}-{size}"
    if (dest / ".complete").is_file():
        return dest
    shutil.rmtree(dest, ignore_errors=True)
    tmp = dest.with_name(f"{dest.name}.tmp{os.getpid()}")
    try:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(tmp)
    except (zipfile.BadZipFile, OSError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"wheel cannot be unpacked: {first_line(exc)} ({wheel})") from exc
    (tmp / ".complete").touch()
    try:
        os.replace(tmp, dest)
    except OSError:  # another process unpacked it first
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def forget_package(top: str, root: Path | None = None) -> None:
    """Drop an imported package ``top`` (and, with ``root``, its wheel folder from sys.path), so another
    version can be imported in this process."""
    for name in [m for m in sys.modules if m == top or m.startswith(top + ".")]:
        del sys.modules[name]
    if root is not None and str(root) in sys.path:
        sys.path.remove(str(root))
