"""What the tests share, by what they need: ``launch`` (subprocesses and torchrun, the reports ranks write),
``worker`` (the one torchrun worker: ``python -m helpers.worker FILE::FUNCTION ARGS``), ``reports`` (what a
layout test compares of a run), ``cli`` (``graphstep`` as a subprocess, killed or failing) and ``data`` (small
datasets and Hugging Face models written under a test's tmp_path). The tiny configs and the same-run assertion
are conftest.py's. Test modules import from here, never from each other."""
