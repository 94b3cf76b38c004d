"""One error tree: every error graphstep raises on purpose is a GraphstepError with an exit code, and the CLI
ends a command with that code (one line for input the user fixes, the traceback for a failed run)."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import graphstep
from graphstep import cli
from graphstep.errors import CaptureError, ConfigError, GraphstepError, InputError

# Every error class the brief of the tree names, where the code raising it imports it from.
RAISED_FROM = {
    "graphstep.config": ["ConfigError"],
    "graphstep.validation": ["ConfigValidationError"],
    "graphstep.validation.stage_split": ["StageSplitError"],
    "graphstep.doctor.cli": ["ScriptError"],
    "graphstep.training.rundir": ["RunSetupError"],
    "graphstep.training.checkpoint": ["CheckpointError"],
    "graphstep.observability.writers": ["MissingExtraError"],
    "graphstep.models.hf": ["HFCheckpointError", "HFExportError"],
    "graphstep.data.cli": ["PreprocessError"],
    "graphstep.data.buckets": ["BucketError"],
    "graphstep.data.indexed": ["IndexedDatasetError"],
    "graphstep.data.sft": ["SFTDataError"],
    "graphstep.data.corpus": ["CorpusNotFoundError"],
    "graphstep.cuda_graph.errors": ["CaptureError", "ContractError", "GraphUsageError"],
}


def _all_error_classes() -> set[type[BaseException]]:
    """Every exception class defined in graphstep (all its modules imported)."""
    for info in pkgutil.walk_packages(graphstep.__path__, "graphstep."):
        if not info.name.endswith("__main__"):  # runs the CLI
            importlib.import_module(info.name)
    found, todo = set(), [BaseException]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if sub.__module__.startswith("graphstep."):
                found.add(sub)
    return found


def test_every_graphstep_error_is_a_graphstep_error_with_an_exit_code():
    classes = _all_error_classes()
    named = {getattr(importlib.import_module(m), n) for m, names in RAISED_FROM.items() for n in names}
    assert named <= classes
    outside = sorted(c.__qualname__ for c in classes if not issubclass(c, GraphstepError))
    assert not outside, f"error classes outside the GraphstepError tree: {outside}"
    for cls in classes:
        assert cls.exit_code in (1, 2), cls
        assert (cls.exit_code == 2) == issubclass(cls, InputError), cls  # input the user fixes: 2; a failed run: 1


def test_the_tree_keeps_the_builtin_bases_callers_catch():
    from graphstep.errors import CorpusNotFoundError
    from graphstep.validation import ConfigValidationError

    assert issubclass(ConfigError, ValueError) and issubclass(ConfigValidationError, ConfigError)
    assert issubclass(CorpusNotFoundError, FileNotFoundError) and issubclass(CorpusNotFoundError, ConfigError)
    assert issubclass(CaptureError, RuntimeError) and CaptureError.exit_code == 1
    exported = {n for n in graphstep.__all__ if n.endswith("Error")}
    assert exported == {n for n in importlib.import_module("graphstep.errors").__all__}


class _Stopped(InputError):
    exit_code = 3  # the CLI reads the attribute, whatever its value


@pytest.mark.parametrize("error", [ConfigError("model.x=1: no such field; remove it"),
                                   _Stopped("three\nlines\nhere")])
def test_the_cli_exits_with_the_errors_exit_code_and_one_line(monkeypatch, capsys, error):
    def command(args):
        raise error

    monkeypatch.setattr(cli, "cmd_config_fields", command)
    assert cli.main(["config", "fields"]) == error.exit_code
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"graphstep config fields: {cli.one_line(error)}"]


def test_the_cli_raises_a_failed_run_with_its_traceback(monkeypatch):
    def command(args):
        raise CaptureError("capture of graph 'step' failed")

    monkeypatch.setattr(cli, "cmd_config_fields", command)
    with pytest.raises(CaptureError):
        cli.main(["config", "fields"])
