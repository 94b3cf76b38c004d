"""Every error graphstep raises on purpose, in one tree under :class:`GraphstepError`.

Each class says what kind of problem it is; its ``exit_code`` says how the
``graphstep`` command ends when the error stops it (cli.py reads the
attribute, never the class)::

    GraphstepError                    1  the run failed: raised with its traceback
    ├── CaptureError                  1  a region cannot be captured or replayed (also a RuntimeError)
    ├── ContractError                 1  a replay call differs from the captured one (also a ValueError)
    ├── GraphUsageError               1  a graphed object used out of order (also a RuntimeError)
    ├── TorchCompatError              1  a private PyTorch name missing or changed (also a RuntimeError)
    └── InputError                    2  input the user fixes: one line, no traceback (also a ValueError)
        ├── ConfigError                  a config, or a file, dataset, checkpoint or package it names
        │   ├── ConfigValidationError    rule violations, all at once (graphstep.validation)
        │   ├── RunSetupError            an output path, the run lock, memory or the device
        │   │   └── CheckpointError      checkpoint.load damaged, missing, or of another model
        │   ├── MissingExtraError        a logging or profiling field without its optional package
        │   ├── HFCheckpointError        model.hf_path that cannot be loaded as it is
        │   ├── HFExportError            an export_hf target that would lose files
        │   ├── IndexedDatasetError      an indexed dataset that cannot be read
        │   ├── SFTDataError             an SFT jsonl line that is not an example
        │   ├── BucketError              a sample no bucket of data.seq_length_buckets holds
        │   ├── StageSplitError          pipeline split fields that do not split the layers
        │   └── CorpusNotFoundError      no standard-library sources for the corpus (also a FileNotFoundError)
        ├── PreprocessError              an input file of ``graphstep preprocess``
        └── ScriptError                  a ``graphstep doctor`` script target that cannot be judged

The mechanism's errors live in cuda_graph/errors.py and TorchCompatError in
cuda_graph/torch_compat.py (``cuda_graph`` imports nothing else of
graphstep); ConfigValidationError lives beside the violations
it lists (validation/report.py), StageSplitError beside the split it checks
(validation/stage_split.py). The modules that raise an error import it
from here.
"""

from __future__ import annotations

from .cuda_graph.errors import CaptureError, ContractError, GraphstepError, GraphUsageError
from .cuda_graph.torch_compat import TorchCompatError

__all__ = [
    "BucketError", "CaptureError", "CheckpointError", "ConfigError", "ContractError", "CorpusNotFoundError",
    "GraphUsageError", "GraphstepError", "HFCheckpointError", "HFExportError", "IndexedDatasetError", "InputError",
    "MissingExtraError", "PreprocessError", "RunSetupError", "SFTDataError", "ScriptError", "TorchCompatError",
]


class InputError(GraphstepError, ValueError):
    """Input the user can fix -- a config, a file, a script -- that graphstep cannot use as it is.

    The message is one line: what, where (the field or ``file:line``) and what to change; ``graphstep``
    prints it without a traceback and exits with code 2.
    """

    exit_code = 2


class ConfigError(InputError):
    """A configuration key or value that graphstep cannot use, or a file, dataset, checkpoint or package it names."""


class RunSetupError(ConfigError):
    """A run that cannot start as configured: an output path, the run lock, memory or the device."""


class CheckpointError(RunSetupError):
    """A checkpoint that cannot be resumed from: damaged, or saved for another model."""


class MissingExtraError(ConfigError):
    """A logging or profiling field needs an optional package that is not installed."""


class HFCheckpointError(ConfigError):
    """A Hugging Face directory graphstep cannot load as it is (the message says what and where)."""


class HFExportError(ConfigError):
    """An export target that would lose files: not empty, a file, or a sharded checkpoint."""


class IndexedDatasetError(ConfigError):
    """An indexed dataset that cannot be read as it is; the message names the file and the position."""


class SFTDataError(ConfigError):
    """A jsonl line that is not a usable example; the message names ``file:line``."""


class BucketError(ConfigError):
    """A sample that no bucket holds."""


class CorpusNotFoundError(ConfigError, FileNotFoundError):
    """The standard library's ``.py`` sources are not on this machine (the embedded corpus needs them)."""


class PreprocessError(InputError):
    """An input graphstep preprocess cannot turn into documents (names file:line)."""


class ScriptError(InputError):
    """A doctor target that cannot be judged: no such file or function, or a script that does not import."""
