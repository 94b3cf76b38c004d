"""See where the time goes: TensorBoard and W&B writers, profiler traces and NVTX ranges.

The trainer (training/loop.py) opens all three at run setup and feeds them
what it already has -- nothing here reads a device value on its own:

* :mod:`.writers` -- ``MetricWriters`` writes the metrics rows the JSONL
  file gets (read from the device once per ``logger.log_interval``) to
  TensorBoard (``logger.tensorboard_dir``) and W&B (``logger.wandb_project``),
  plus the capture events. A missing optional package is refused by
  validation (rule V21) before anything is built.
* :mod:`.profiler` -- ``StepProfiler``: a PyTorch profiler trace of
  iterations ``profiling.profile_step_start..profile_step_end``, nsys's
  capture range (cudaProfilerStart/Stop) and the CUDA memory history.
* :mod:`.nvtx` -- ``PhaseRanges``: named ranges (data, warm-up, capture,
  replay, optimizer) for nsys and the PyTorch profiler; nothing at all when
  neither profiles.
"""

from .nvtx import PhaseRanges, open_ranges
from .profiler import StepProfiler, trace_dir
from .writers import MetricWriters, MissingExtraError

__all__ = ["MetricWriters", "MissingExtraError", "PhaseRanges", "StepProfiler", "open_ranges", "trace_dir"]
