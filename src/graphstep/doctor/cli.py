"""``graphstep doctor``: capture readiness of a recipe's step, or of a function in a script.

    graphstep doctor --recipe llama3_8b [section.field=value ...] [--full-size] [--json]
    graphstep doctor path/to/train.py:train_step [--inputs make_inputs] [--json]

A recipe is resolved like ``graphstep train`` resolves it, validated, and its
step judged where its graphs capture (recipe.py). A script is imported (its
``if __name__ == "__main__"`` block does not run) and ``function`` is judged
with the arguments that ``--inputs`` (default: ``<function>_inputs`` when the
script defines it) returns: a tuple of positional arguments, or a dict of
keyword arguments; without one the function is called with no arguments.

Exit status: 0 no finding, 1 a finding breaks capture, 2 the doctor could
not judge the step (a config rule is broken; no such script or function; the
script does not import -- one line naming file:line), 3 only findings that
corrupt replays (see findings.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from typing import Any

from ..config_files import add_config_args, config_from_args
from ..errors import ScriptError
from .findings import Report


def add_doctor(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doctor", help="find what breaks CUDA-graph capture or replay in a step, with file:line and the fix",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(p)
    p.add_argument("--full-size", action="store_true",
                   help="run a big recipe as configured instead of a proxy of the same structure")
    p.add_argument("--inputs", help="script mode: a zero-argument function of the script returning the step's "
                                    "arguments (default: <function>_inputs if defined)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(fn=cmd_doctor)


def cmd_doctor(args: argparse.Namespace) -> int:
    targets = [o for o in args.overrides if _is_target(o)]
    args.overrides = [o for o in args.overrides if not _is_target(o)]
    if len(targets) > 1:
        raise ScriptError(f"one script target at a time, got {' '.join(targets)}")
    if targets:
        report = check_script(targets[0], args.inputs)
    else:
        from .recipe import check_recipe

        keep = {o.split("=", 1)[0].strip().lstrip("+") for o in args.overrides if "=" in o}
        keep |= {"model.cuda_graph_impl", "model.cuda_graph_scope"} if args.cuda_graph_impl or args.cuda_graph_scope else set()
        report = check_recipe(config_from_args(args), name=args.recipe, full_size=args.full_size, keep=keep)
    print(report.to_json() if args.json else report.format())
    return report.exit_code


def _is_target(text: str) -> bool:
    path = text.split(":", 1)[0]
    return "=" not in text and path.endswith(".py")


def check_script(target: str, inputs: str | None = None) -> Report:
    """Judge ``path.py:function`` (see module docstring)."""
    from .session import analyze

    path, _, fname = target.partition(":")
    if not fname:
        raise ScriptError(f"{path}: name the step function as {path}:FUNCTION")
    module = _import_script(path)
    fn = getattr(module, fname, None)
    if fn is None or not callable(fn):
        raise ScriptError(f"{path}: no function {fname!r} (write {path}:FUNCTION with a function the script "
                          "defines at module level)")
    call_args, call_kwargs = _inputs(module, fname, inputs)
    return analyze(fn, call_args, call_kwargs, name=target)


def _import_script(path: str) -> Any:
    if not os.path.isfile(path):
        raise ScriptError(f"{path}: no such file")
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in sys.path:
        sys.path.insert(0, folder)  # the script's own imports of its neighbours
    name = "_graphstep_doctor_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:
        sys.modules.pop(name, None)
        if not isinstance(exc, Exception):
            raise
        _import_failed(path, exc)
    return module


def _import_failed(path: str, exc: Exception) -> None:
    """Raise the one-line ScriptError for a script that does not import."""
    if isinstance(exc, SyntaxError):
        where = f"{exc.filename or path}:{exc.lineno or 0}"
        raise ScriptError(f"{where}: SyntaxError: {exc.msg}; fix the script (python {path} shows the same)") from None
    raise ScriptError(f"{_line_in(path, exc)}: importing the script raised {type(exc).__name__}: "
                      f"{' '.join(str(exc).split())}; fix it (the doctor imports the script without running its "
                      "__main__ block)") from None


def _line_in(path: str, exc: BaseException) -> str:
    """``path:line`` of the innermost frame of ``exc``'s traceback inside the script (``path`` alone if none)."""
    import traceback

    real = os.path.realpath(path)
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if os.path.realpath(f.filename) == real]
    return f"{path}:{frames[-1].lineno}" if frames else path


def _inputs(module: Any, fname: str, inputs: str | None) -> tuple[tuple, dict]:
    name = inputs or f"{fname}_inputs"
    make = getattr(module, name, None)
    if make is None:
        if inputs:
            raise ScriptError(f"{module.__file__}: no function {inputs!r} (--inputs names a function of the script)")
        return (), {}
    value = make()
    if isinstance(value, dict):
        return (), value
    return (tuple(value) if isinstance(value, (tuple, list)) else (value,)), {}
