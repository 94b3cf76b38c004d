"""Bench peer ``torchtitan_cuda_graph``: torchtitan's own CUDA graph wrapper, as its trainer uses it.

torchtitan's trainer (release 0.3.0) wraps its per-micro-batch forward+backward
body in ``torchtitan.distributed.cudagraph.wrap_with_cuda_graph``: the first
call runs eagerly on the wrapper's side stream, the second is captured, later
calls copy the micro-batch into the captured inputs and replay; the optimizer
runs eagerly after the micro-batches. The row does exactly that around the
same model, gradient buffers and optimizer as graphstep's rows (bench/harness.py
``make_workload``): one graph, replayed once per micro-batch.

torchtitan is not a dependency: the row loads ``torchtitan/distributed/cudagraph.py``
from a wheel (``$GRAPHSTEP_TORCHTITAN_WHEEL`` or ``vendor/torchtitan-*.whl``;
``scripts/fetch-torchtitan``). Only what that module imports is imported:
``torchtitan.distributed``'s package initialiser is not run (it imports the
parallel layouts and their dependencies, which the wrapper does not use). A
missing dependency fails the row with its name.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any, Iterator

import torch

from .wheels import extract_wheel, find_wheel, first_line

ROW = "torchtitan_cuda_graph"
WHEEL_ENV = "GRAPHSTEP_TORCHTITAN_WHEEL"
TESTED_VERSION = "0.3.0"
FETCH = "run scripts/fetch-torchtitan"


def load_cudagraph() -> types.ModuleType:
    """``torchtitan.distributed.cudagraph`` from the wheel; RuntimeError naming the wheel and the reason."""
    wheel = find_wheel("torchtitan", WHEEL_ENV, FETCH)
    if "torchtitan.distributed.cudagraph" in sys.modules:
        return sys.modules["torchtitan.distributed.cudagraph"]
    root = extract_wheel(wheel)
    package = root / "torchtitan" / "distributed"
    if not (package / "cudagraph.py").is_file():
        raise RuntimeError(f"torchtitan too old: no torchtitan/distributed/cudagraph.py in {wheel.name} "
                           f"(tested {TESTED_VERSION})")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    if "torchtitan.distributed" not in sys.modules:  # the package without its initialiser (see the module doc)
        stub = types.ModuleType("torchtitan.distributed")
        stub.__path__ = [str(package)]
        sys.modules["torchtitan.distributed"] = stub
    try:
        module = importlib.import_module("torchtitan.distributed.cudagraph")
    except Exception as exc:
        for name in [m for m in sys.modules if m == "torchtitan" or m.startswith("torchtitan.")]:
            del sys.modules[name]
        if isinstance(exc, ImportError) and exc.name and not exc.name.startswith("torchtitan"):
            reason = f"missing dependency {exc.name!r}"
        else:
            reason = first_line(exc)
        raise RuntimeError(f"torchtitan import failed: {reason} (from {wheel})") from exc
    for attr in ("wrap_with_cuda_graph", "cudagraph_teardown"):
        if not hasattr(module, attr):
            raise RuntimeError(f"torchtitan {version()} not supported: torchtitan.distributed.cudagraph lacks "
                               f"{attr} (tested {TESTED_VERSION})")
    return module


def version() -> str:
    return getattr(sys.modules.get("torchtitan"), "__version__", "?")


def torchtitan_graph(cfg, device: torch.device) -> tuple[Any, Iterator[Any], Any, Any]:
    """(step, data, capture seconds, owner): torchtitan's wrapper around each micro-batch's forward+backward."""
    import time

    from .harness import make_workload

    cudagraph = load_cudagraph()
    if device.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError(f"{ROW} needs a CUDA device, got {device} (torchtitan's wrapper falls back to eager "
                           "without one, which would measure eager)")
    w = make_workload(cfg, device)
    n = w.num_micro_batches

    def body(tokens: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor, extra: dict[str, Any]) -> torch.Tensor:
        # graphstep's TrainStep per micro-batch: the mean token loss, backward of loss / n into the fp32 buffers
        loss = w.model(tokens, labels, extra.get("loss_mask"))
        (loss * scale).backward()
        return loss.detach()

    fwd_bwd = cudagraph.wrap_with_cuda_graph(body)
    scale = torch.full((), 1.0 / n, device=device)
    capture: list[float] = []

    def step(it: Iterator[Any]) -> Any:
        batches = [{k: v.to(device, non_blocking=True) for k, v in next(it).items()} for _ in range(n)]
        w.grads.zero()
        total = torch.zeros((), dtype=torch.float32, device=device)
        for mb in batches:
            extra = {"loss_mask": mb["loss_mask"]} if "loss_mask" in mb else {}
            t0 = time.perf_counter()
            loss = fwd_bwd(mb["tokens"], mb["labels"], scale, extra)
            if len(capture) < 2:  # the first call is the eager warm-up, the second captures and replays
                torch.cuda.synchronize(device)
                capture.append(time.perf_counter() - t0)
            total.add_(loss)  # the output is graph-owned: consumed before the next replay overwrites it
        result = w.optimizer.step(None)
        return total / n, result

    class Owner:
        def close(self) -> None:
            cudagraph.cudagraph_teardown()

    return step, w.data(), lambda: capture[1] if len(capture) > 1 else None, Owner()
