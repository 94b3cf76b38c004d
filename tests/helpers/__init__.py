"""What the tests share, by what they need: ``launch`` (subprocesses and torchrun, the reports ranks write),
``worker`` (the one torchrun worker: ``python -m helpers.worker FILE::FUNCTION ARGS``), ``reports`` (what a
layout test compares of a run), ``cli`` (``graphstep`` as a subprocess, killed or failing), ``data`` (small
datasets and Hugging Face models written under a test's tmp_path) and ``runs`` (the tiny configs and the
same-run assertion). Test modules import from here, never from each other or from conftest.py (fixtures only)."""


def aten_cpu_matmuls() -> None:
    """CPU matmuls through ATen's own kernels, not oneDNN's, in this process (the test process and every worker).

    On a CPU with AMX and AVX512-FP16, oneDNN's FP8 matmul -- what ``torch._scaled_mm`` (torchao's float8 and
    graphstep's delayed scaling) runs on the CPU -- took 0.58 s for one 256x256x256 product against 1 ms through
    ATen (torch 2.13.0, 2026-12-07), and the FP8 tests 30 minutes instead of 1. Graphed and eager runs of a test
    share the process, hence the setting: every comparison stays like for like."""
    import torch

    torch.backends.mkldnn.enabled = False
