"""The A/B performance harness: every row of one shape, in one process, on one GPU (or one per GPU).

A row is one way to run the same training iteration (forward and backward of
every micro-batch, then the optimizer step) on the same model and data:
eager, graphstep's graph settings, and the peers a user would try instead
(bench/peers.py). Each row is measured the same way (device/METHOD.md):

* warm-up iterations first (the capture happens there; its time is reported
  separately), then ``iters`` iterations back to back with a CUDA event
  after each: the median interval is the step time (host-limited rows show
  their host time, device-limited rows their device time);
* GPU-busy time: the sum of kernel and copy durations per iteration from the
  profiler over a few more iterations -- the floor no launch scheme beats;
  host overhead = step - busy;
* peak allocated and reserved memory over the row (model, optimizer, graphs
  and their pools included), after the previous row was freed and cuBLAS's
  per-stream workspaces cleared; what was still allocated at the start is
  recorded (``start_allocated_gib``).

Every row's model, optimizer, steps and graphs are built by the trainer's
own ``build_run`` (training/build.py), so a row measures what ``graphstep
train`` runs (its RNG tracker setting, MoE hooks and non-finite checks
included); the peers take their model and optimizer from the same build.
Batches are generated once, pinned, and cycled, so data generation is not
timed. Ratios (speed-up vs eager, step/floor) are computed within one run,
against the eager row of the same layout (:func:`eager_reference`), and
against the row's peer (:func:`peer_of`) when the run measured it.

Rounds (``graphstep bench --rounds N``): host-bound rows vary by a quarter
between runs on one machine, with the host's load. With N rounds every row
is built and measured once per round, the rows interleaved (A B C A B C ...),
so the rows compared share each round's host conditions; a row's step time
is the median over the rounds, ``step_ms_rounds`` its spread, and its ratio
to its peer is taken round by round (:func:`combine_rounds`, :func:`finish`).

Under torchrun (bench/ranks.py) every rank runs every row with the same
warm-up and iteration counts, so their collectives match; a row's layout is
joined through the trainer's ``init_data_parallel`` over the bench's process
group. :func:`measure` takes a :class:`Lockstep` there: the ranks agree that
every one of them built the row before any step runs (a rank that could not
would otherwise leave the others waiting in a collective), and at the end
peak memory becomes the maximum over the ranks.
"""

from __future__ import annotations

import copy
import gc
import re
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Protocol

import torch

from ..config import Config, apply_overrides
from ..cuda_graph.devices import GiB
from ..cuda_graph.registry import close_all_backends
from ..cuda_graph.torch_compat import clear_cublas_workspaces
from ..data import build_data
from ..validation import resolve_cuda_graph_settings
from ..training.build import Run, RunOptions, build_run
from ..training.distributed import DataParallel, init_data_parallel
from ..training.optim import GradBuffers
from ..parallel.dims import ParallelDims
from ..training.step import TrainStep
from ..engines_compat import reset_dynamo
from .layouts import ONE_RANK_MESH, TORCHRUN_ONLY



@dataclass
class Row:
    """One measured row (times in ms, memory in GiB)."""

    name: str
    step_ms: float | None = None
    busy_ms: float | None = None
    kernels: int | None = None
    peak_allocated_gib: float | None = None
    peak_reserved_gib: float | None = None
    capture_s: float | None = None
    host_syncs: int | None = None  # synchronising CUDA calls in one step (torch.cuda.set_sync_debug_mode)
    start_allocated_gib: float | None = None  # still allocated when the row started (earlier rows' leftovers)
    step_ms_all: list[float] = field(default_factory=list)
    error: str | None = None
    note: str = ""
    layout: str | None = None  # the ranks the row ran on (ParallelDims.describe()); None for a peer
    ranks: int = 1  # GPUs the row ran on (MFU is against all of them)
    global_batch: int | None = None  # sequences per iteration over all ranks (None: the recipe's)
    tokens_per_step: int | None = None  # tokens per iteration over all ranks (None: the recipe's)
    step_ms_rounds: list[float] = field(default_factory=list)  # each round's median (``--rounds``)
    host_profile: list[dict[str, Any]] = field(default_factory=list)  # ``--host-profile``: :func:`host_profile`
    host_ops: list[dict[str, Any]] = field(default_factory=list)  # ``--host-profile``: :func:`host_ops`
    # filled in by finish()
    host_ms: float | None = None
    # the host's time to issue one step with the device idle (:func:`issue_time`): over busy_ms, the row is host-bound
    issue_ms: float | None = None
    peer: str | None = None  # the row of another library doing the same job (:func:`peer_of`)
    vs_peer: float | None = None  # step / the peer's step: the median over rounds of each round's ratio
    vs_peer_rounds: list[float] = field(default_factory=list)
    speedup: float | None = None
    floor_ratio: float | None = None
    memory_vs_eager: float | None = None
    memory_vs_peer: float | None = None  # peak allocated / the peer's (a lora_ row: against full fine-tuning)
    tokens_per_s: float | None = None
    tflops: float | None = None
    mfu: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Workload:
    """A fresh run (model, optimizer, steps, graphs: ``build_run``) and pinned batches for one row."""

    run: Run
    batches: list[dict[str, torch.Tensor]]
    dp: DataParallel | None = None  # the row's ranks (FSDP2's one-rank group, or its layout under torchrun)

    @property
    def cfg(self) -> Config:
        return self.run.cfg

    @property
    def device(self) -> torch.device:
        return self.run.device

    @property
    def model(self) -> torch.nn.Module:
        return self.run.model

    @property
    def grads(self) -> GradBuffers:
        return self.run.grads

    @property
    def optimizer(self) -> Any:
        return self.run.optimizer

    @property
    def train_step(self) -> TrainStep:
        return self.run.train_step

    @property
    def num_micro_batches(self) -> int:
        return self.run.num_micro_batches

    def data(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            yield from self.batches

    def close(self) -> None:
        self.run.close()
        if self.dp is not None:
            self.dp.close()  # after the graphs: none may hold a collective when the group goes


def make_workload(cfg: Config, device: torch.device, n_steps: int = 4, *,
                  compile_mode: str | None = None, world_size: int = 1) -> Workload:
    """The row's run, built as the trainer builds it, and ``n_steps`` iterations of this rank's pinned batches.

    ``world_size`` > 1 (torchrun, bench/ranks.py): the row's layout over the
    bench's process group, through the trainer's ``init_data_parallel``. The
    sub-groups it makes for the row (a gloo group for host-side agreement,
    the mesh's groups) stay open until the bench's process group is
    destroyed at the end of the run: NCCL communicators of earlier rows hold
    device memory outside the caching allocator (not in the peak columns).
    """
    settings = resolve_cuda_graph_settings(cfg, world_size=world_size)
    dp = None
    if world_size > 1:
        dp = init_data_parallel(cfg, settings)
    elif ParallelDims.from_config(cfg, 1).needs_mesh:  # FSDP2 on one GPU: the trainer's one-rank group and mesh
        dp = init_data_parallel(cfg, settings, env={})
    run = build_run(cfg, RunOptions(device, dp=dp, settings=settings, compile_mode=compile_mode))
    rank = dp.data_shard() if dp is not None else {}
    it = build_data(cfg, split="train", pin_memory=device.type == "cuda", **rank)
    batches = [next(it) for _ in range(n_steps * run.num_micro_batches)]
    return Workload(run, batches, dp)


def row_config(base: Config, overrides: list[str]) -> Config:
    import copy

    cfg = copy.deepcopy(base)
    apply_overrides(cfg, overrides)
    return cfg


def graphstep_row(cfg: Config, device: torch.device, *, compile_mode: str | None = None, world_size: int = 1,
                  ) -> tuple[Callable[[Iterator[Any]], Any], Workload, Any]:
    """A row run as the trainer runs it (``build_run``): the iteration function, the workload and its owner.

    ``compile_mode``: the step calls ``torch.compile(model, mode=compile_mode)``
    (the graphs then capture Inductor's kernels). The owner's ``runner.reports``
    are the row's own captures.
    """
    w = make_workload(cfg, device, compile_mode=compile_mode, world_size=world_size)
    return w.run.iteration, w, w.run.runner


def time_steps(step: Callable[[Iterator[Any]], Any], data: Iterator[Any], *, warmup: int, iters: int,
               device: torch.device) -> tuple[list[float], float]:
    """Per-iteration intervals between CUDA events (ms) after ``warmup`` steps; returns (intervals, warmup s)."""
    t0 = time.perf_counter()
    for _ in range(warmup):
        step(data)
    torch.cuda.synchronize(device)
    warm_s = time.perf_counter() - t0
    events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
    events[0].record()
    for i in range(iters):
        step(data)
        events[i + 1].record()
    torch.cuda.synchronize(device)
    return [events[i].elapsed_time(events[i + 1]) for i in range(iters)], warm_s


def busy_time(step: Callable[[Iterator[Any]], Any], data: Iterator[Any], *, iters: int,
              device: torch.device) -> tuple[float, int]:
    """(GPU-busy ms, kernels) per iteration: the sum of device activity durations from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step(data)
        torch.cuda.synchronize(device)
    total_us, kernels = 0.0, 0
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            total_us += evt.time_range.elapsed_us()
            kernels += 1
    return total_us / 1e3 / iters, round(kernels / iters)


def issue_time(step: Callable[[Iterator[Any]], Any], data: Iterator[Any], *, iters: int,
               device: torch.device) -> float:
    """The host's time to issue one step (ms, the median of ``iters``): the device is drained before each step, so
    no launch waits for room in its queue and the host clock measures the host's own work (a step that waits on the
    device -- a host sync -- counts that wait too). A row whose issue time is over its GPU-busy time is host-bound:
    its step time is the host's."""
    times = []
    for _ in range(iters):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        step(data)
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize(device)
    return statistics.median(times)


SYNC_WARNING = "called a synchronizing CUDA operation"  # torch.cuda.set_sync_debug_mode("warn")


def count_host_syncs(step: Callable[[Iterator[Any]], Any], data: Iterator[Any]) -> int:
    """Synchronising CUDA calls (``.item()``, blocking copies, ...) during one step."""
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(data)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # Only the per-call warning counts. Switching the mode on also warns, once per process, that the mode is
    # "a prototype feature and does not yet detect all synchronizing operations": counted, it made the first
    # row of every run (eager) show one sync that no step made.
    return sum(SYNC_WARNING in str(w.message) for w in caught)


def host_profile(step: Callable[[Iterator[Any]], Any], data: Iterator[Any], *, iters: int, top: int,
                 device: torch.device) -> list[dict[str, Any]]:
    """Where the host spends a step: ``top`` Python functions by own time under cProfile, per iteration.

    Each entry: ``function`` (``path:line(name)``, the path from its package root), ``calls``, ``self_ms``
    (time in the function itself) and ``total_ms`` (with what it calls). cProfile slows the host, so these
    times are larger than the row's host column; they say where the host time goes, not how much there is.
    """
    import cProfile
    import pstats

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda _: None)
    sync(device)
    prof = cProfile.Profile()
    prof.enable()
    try:
        for _ in range(iters):
            step(data)
        sync(device)  # the host waits for the device here: that wait is the step's too
    finally:
        prof.disable()
    stats = pstats.Stats(prof).stats  # {(file, line, name): (primitive calls, calls, own s, total s, callers)}
    ranked = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return [{"function": f"{_short_path(file)}:{line}({name})", "calls": calls / iters,
             "self_ms": own * 1e3 / iters, "total_ms": total * 1e3 / iters}
            for (file, line, name), (_, calls, own, total, _) in ranked]


def host_ops(step: Callable[[Iterator[Any]], Any], data: Iterator[Any], *, iters: int, top: int,
             device: torch.device) -> list[dict[str, Any]]:
    """The host time of a step's torch operators on every thread: ``top`` of them by own CPU time, per iteration.

    cProfile (:func:`host_profile`) sees only the calling thread; autograd runs a CUDA backward on its own
    device thread, whose nodes (``autograd::engine::evaluate_function: ...Backward``, a graphed module's
    backward replay among them) this table shows. On a GPU the CUDA runtime calls are among them too
    (``cudaLaunchKernel``, ``cudaGraphLaunch``, and any ``cudaStreamSynchronize`` or device-to-host copy: a
    host wait shows as their time). Each entry: ``op``, ``calls``, ``self_ms``, ``total_ms``.
    """
    from torch.profiler import ProfilerActivity, profile

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda _: None)
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(iters):
            step(data)
        sync(device)
    ranked = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return [{"op": e.key, "calls": e.count / iters, "self_ms": e.self_cpu_time_total / 1e3 / iters,
             "total_ms": e.cpu_time_total / 1e3 / iters} for e in ranked]


def _short_path(file: str) -> str:
    """``graphstep/cuda_graph/replay.py`` for ``/.../src/graphstep/cuda_graph/replay.py``; builtins as given."""
    parts = file.replace("\\", "/").split("/")
    for root in ("graphstep", "torch", "megatron", "torchtitan", "torchao"):
        if root in parts:
            return "/".join(parts[len(parts) - 1 - parts[::-1].index(root):])
    return parts[-1]


def free_row() -> None:
    close_all_backends()
    reset_dynamo()  # compiled rows: their graphs (and CUDA graph trees) go with them
    gc.collect()
    torch.cuda.synchronize()
    clear_cublas_workspaces()  # the per-(thread, stream) cuBLAS workspaces of earlier rows: each row pays its own
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


class Lockstep(Protocol):
    """What the ranks of a torchrun-launched bench agree on for each row (bench/ranks.py: Ranks)."""

    def all_built(self, built: bool) -> None:
        """Every rank says whether it built the row; raises on a rank that did when another did not."""

    def reduce_row(self, row: Row) -> None:
        """Peak memory becomes the maximum over the ranks; a row failed on any rank is failed."""


def measure(name: str, build: Callable[[], tuple[Callable, Iterator[Any], Callable[[], float] | None, Any]],
            *, warmup: int, iters: int, profile_iters: int, device: torch.device,
            lockstep: Lockstep | None = None, host_top: int = 0) -> Row:
    """Build a row (returns step, data, capture-seconds getter, owner), time it, free it.

    ``lockstep`` (torchrun): every rank calls this for the same row; the times are this rank's.
    ``host_top`` > 0: also the row's :func:`host_profile` (that many functions), after the timed steps.
    """
    free_row()
    row = Row(name, start_allocated_gib=torch.cuda.memory_allocated(device) / GiB)
    owner = None
    try:
        built = False
        try:
            step, data, capture_s, owner = build()
            row.note = getattr(owner, "note", "") or row.note  # what a peer did differently, said beside it
            built = True
        finally:
            if lockstep is not None:  # on every rank, built or not, before the row's first step
                lockstep.all_built(built)
        times, warm_s = time_steps(step, data, warmup=warmup, iters=iters, device=device)
        row.step_ms_all = times
        row.step_ms = statistics.median(times)
        row.capture_s = capture_s() if capture_s is not None else None
        # as the process saw it, so never under-counted; start_allocated_gib says what of it
        # earlier rows left (~0 since free_row clears cuBLAS's workspaces)
        row.peak_allocated_gib = torch.cuda.max_memory_allocated(device) / GiB
        row.peak_reserved_gib = torch.cuda.max_memory_reserved(device) / GiB
        row.busy_ms, row.kernels = busy_time(step, data, iters=profile_iters, device=device)
        row.issue_ms = issue_time(step, data, iters=profile_iters, device=device)
        row.host_syncs = count_host_syncs(step, data)
        if host_top > 0:
            row.host_profile = host_profile(step, data, iters=profile_iters, top=host_top, device=device)
            row.host_ops = host_ops(step, data, iters=profile_iters, top=host_top, device=device)
    except Exception as exc:  # a row that fails is a result, not the end of the run
        row.error = f"{type(exc).__name__}: {exc}"[:2000]
    finally:
        if owner is not None and hasattr(owner, "close"):
            owner.close()
        del owner
        free_row()
    if lockstep is not None:
        lockstep.reduce_row(row)
    return row




def eager_reference(name: str, measured: set[str]) -> str:
    """The eager row ``name``'s ratios are against: ``eager`` for one-process rows (``fsdp_`` and ``zero2_``
    ones too, as on one GPU); ``<layout>_eager`` for the multi-rank layouts, and for ``fsdp_``/``zero2_`` rows
    when the run has no plain ``eager`` row (under torchrun); ``lora_eager`` for ``lora_`` rows when measured."""
    if name.startswith("lora_") and "lora_eager" in measured:
        return "lora_eager"
    for prefix in TORCHRUN_ONLY:  # rows whose eager reference is their own layout's
        if name.startswith(prefix):
            return "dp_eager" if prefix == "dp_overlap_" else prefix + "eager"
    for prefix in ONE_RANK_MESH:
        if name.startswith(prefix) and "eager" not in measured:
            return prefix + "eager"
    return "eager"


def combine_rounds(rounds: list[Row]) -> Row:
    """One row from its measurements in successive rounds (``graphstep bench --rounds``).

    The step, GPU-busy and issue times are the medians over the rounds (``step_ms_rounds`` keeps each round's),
    peak memory and host syncs the largest seen, the capture time the median; a row that failed in any
    round is failed, with that round's error.
    """
    if len(rounds) == 1:
        return rounds[0]
    for k, r in enumerate(rounds):
        if r.error:
            failed = copy.copy(r)
            failed.error = f"round {k + 1} of {len(rounds)}: {r.error}"
            return failed
    row = copy.copy(rounds[0])
    row.step_ms_rounds = [r.step_ms for r in rounds]
    row.step_ms = statistics.median(row.step_ms_rounds)
    row.step_ms_all = [t for r in rounds for t in r.step_ms_all]
    busy = [r.busy_ms for r in rounds if r.busy_ms]
    row.busy_ms = statistics.median(busy) if busy else None
    captures = [r.capture_s for r in rounds if r.capture_s is not None]
    row.capture_s = statistics.median(captures) if captures else None
    issues = [r.issue_ms for r in rounds if r.issue_ms is not None]
    row.issue_ms = statistics.median(issues) if issues else None
    for name in ("peak_allocated_gib", "peak_reserved_gib", "host_syncs"):
        values = [getattr(r, name) for r in rounds if getattr(r, name) is not None]
        setattr(row, name, max(values) if values else None)
    return row


def peer_of(name: str, names: set[str]) -> str | None:
    """The row of another library doing ``name``'s job, when the run measured it: per-layer graphs against
    ``torch.cuda.make_graphed_callables``, a whole-step graph against a hand-written ``torch.cuda.graph``
    step, compile + graphs against ``torch.compile(mode="reduce-overhead")``, an FP8 row (``fp8_``,
    ``fp8_delayed_``, ``compile+fp8_``) against the same row in bf16, a ``lora_`` row against the same row
    fine-tuning every weight."""
    fp8 = re.match(r"(compile\+)?(fp8_delayed_|fp8_)", name)
    if name.endswith("+optimizer") and name != "full_iteration+optimizer":
        return None  # the peers of per-layer rows run their optimizer eagerly: not the same job
    if fp8:  # an FP8 row against the same row in bf16
        peer = (fp8.group(1) or "") + name[fp8.end():]
    elif name.startswith("lora_"):  # LoRA against full fine-tuning
        peer = name[len("lora_"):]
    elif name.startswith("compile+"):
        peer = "compile[reduce-overhead]"
    elif name.startswith(("local[", "te[")):
        peer = "make_graphed_callables"
    elif name in ("full_iteration", "full_iteration+optimizer"):
        peer = "manual_graph"
    else:
        return None
    return peer if peer in names else None


def finish(rows: list[Row], *, tokens_per_step: int, flops_per_step: float, peak_tflops: float) -> None:
    """Derived columns, against the eager row of the same layout (:func:`eager_reference`).

    ``tokens_per_step`` and ``flops_per_step`` are the recipe's; a row with its own ``tokens_per_step``
    (a multi-rank layout's global batch) scales the FLOPs with its tokens, and its MFU is against the
    peak of all its ``ranks``.
    """
    measured: dict[str, Row] = {}
    for r in rows:
        if r.step_ms:
            measured.setdefault(r.name, r)
    for r in rows:
        if not r.step_ms:
            continue
        tokens = r.tokens_per_step or tokens_per_step
        if r.busy_ms:
            r.host_ms = r.step_ms - r.busy_ms
            r.floor_ratio = r.step_ms / r.busy_ms
        r.tokens_per_s = tokens / (r.step_ms / 1e3)
        r.tflops = flops_per_step * (tokens / tokens_per_step) / (r.step_ms / 1e3) / 1e12
        r.mfu = r.tflops / (peak_tflops * r.ranks) if peak_tflops else None
        eager = measured.get(eager_reference(r.name, set(measured)))
        if eager is not None:
            r.speedup = eager.step_ms / r.step_ms
            if eager.peak_allocated_gib:
                r.memory_vs_eager = r.peak_allocated_gib / eager.peak_allocated_gib
        peer = measured.get(peer_of(r.name, set(measured)) or "")
        if peer is not None:
            r.peer = peer.name
            # round by round: the two rows of one round ran under the same host conditions
            pairs = list(zip(r.step_ms_rounds, peer.step_ms_rounds)) or [(r.step_ms, peer.step_ms)]
            r.vs_peer_rounds = [a / b for a, b in pairs]
            r.vs_peer = statistics.median(r.vs_peer_rounds)
            if r.peak_allocated_gib and peer.peak_allocated_gib:
                r.memory_vs_peer = r.peak_allocated_gib / peer.peak_allocated_gib


def matmul_tflops(device: torch.device, n: int = 8192, reps: int = 10) -> float:
    """Measured dense bf16 matrix rate (random data, median of ``reps`` after warm-up)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        a @ b
        e.record()
        torch.cuda.synchronize(device)
        times.append(s.elapsed_time(e))
    del a, b
    return 2 * n**3 / (statistics.median(times) / 1e3) / 1e12
