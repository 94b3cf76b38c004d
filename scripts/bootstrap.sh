# Sourced by scripts/train, scripts/test and scripts/graphstep: find or make a Python that has
# graphstep's dependencies, and export GS_PY (the interpreter to use).
#
# 1. A Python that already imports torch and the other dependencies (the GPU
#    machine's image) is reused as it is, with src/ on PYTHONPATH.
# 2. Otherwise a virtual environment .venv is made (seeing the system's
#    site-packages when the system Python has torch, so a CUDA torch is
#    reused), CPU torch 2.13.0 is installed where no torch is importable, and
#    graphstep is installed in editable mode with its test extras.
set -e
GS_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$GS_ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
GS_BASE_PY="${GRAPHSTEP_PYTHON:-$(command -v python3 || command -v python)}"
GS_MODULES="torch, numpy, yaml, rich, pytest, hypothesis"

if [ -z "${GRAPHSTEP_FORCE_VENV:-}" ] && "$GS_BASE_PY" -c "import $GS_MODULES" 2>/dev/null; then
    GS_PY="$GS_BASE_PY"
else
    VENV="$GS_ROOT/.venv"
    STAMP="$VENV/.graphstep-installed"
    WANT="$(cat "$GS_ROOT/pyproject.toml" | cksum)"
    if [ ! -x "$VENV/bin/python" ]; then
        if "$GS_BASE_PY" -c "import torch" 2>/dev/null; then
            echo "bootstrap: creating $VENV (reusing the system torch)" >&2
            "$GS_BASE_PY" -m venv --system-site-packages "$VENV"
        else
            echo "bootstrap: creating $VENV" >&2
            "$GS_BASE_PY" -m venv "$VENV"
        fi
    fi
    if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
        "$VENV/bin/python" -m pip install -q --upgrade pip >&2 || true
        if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
            echo "bootstrap: installing CPU torch 2.13.0" >&2
            "$VENV/bin/python" -m pip install -q "torch==2.13.0" >&2
        fi
        echo "bootstrap: installing graphstep and its test dependencies" >&2
        "$VENV/bin/python" -m pip install -q -e "$GS_ROOT[test]" >&2
        echo "$WANT" > "$STAMP"
    fi
    GS_PY="$VENV/bin/python"
fi
export GS_PY
set +e
