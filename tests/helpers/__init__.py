"""What the tests share, by what they need: ``launch`` (subprocesses and torchrun, the reports ranks write),
``worker`` (the one torchrun worker: ``python -m helpers.worker FILE::FUNCTION ARGS``), ``reports`` (what a
layout test compares of a run), ``cli`` (``graphstep`` as a subprocess, killed or failing), ``data`` (small
datasets and Hugging Face models written under a test's tmp_path) and ``runs`` (the tiny configs and the
same-run assertion). Test modules import from here, never from each other or from conftest.py (fixtures only)."""
