"""The errors raygraph raises on purpose, under one base: `RaygraphError`.

Every error whose message is complete and actionable (a config typo, a missing file, a dead
role, a damaged checkpoint, a reward that cannot be computed, a recovery that gave up) derives
from one of the families below; the command line prints its message without a traceback and
exits with the family's `exit_code` (2: fix the input and rerun; 1: the run failed). Anything
else is a bug and keeps its traceback.

Concrete classes keep their builtin base too (`ValueError`, `RuntimeError`), so code that
catches those still works.
"""

from __future__ import annotations

__all__ = ["RaygraphError", "ConfigInvalid", "DataInvalid", "RoleFailed", "CheckpointInvalid", "RewardFailed",
           "RecoveryFailed", "BadConfig", "BadData", "MissingInput", "MissingColumn", "EXIT_FAILED", "EXIT_BAD_INPUT"]

EXIT_FAILED, EXIT_BAD_INPUT = 1, 2


class RaygraphError(Exception):
    """An error with a complete message for the user; `exit_code` is what `raygraph` exits with."""

    exit_code = EXIT_FAILED


class ConfigInvalid(RaygraphError):
    """The config, a workflow, or user code it names is wrong (caught before anything starts)."""

    exit_code = EXIT_BAD_INPUT


class DataInvalid(RaygraphError):
    """A dataset, tokenizer or model file is missing or unusable."""

    exit_code = EXIT_BAD_INPUT


class RoleFailed(RaygraphError):
    """A role's actor failed, died, could not be placed, or a weight sync failed."""


class CheckpointInvalid(RaygraphError):
    """A checkpoint is damaged, incomplete or does not match the run."""


class RewardFailed(RaygraphError):
    """A reward could not be computed (a non-finite score, a failing user function or service)."""


class RecoveryFailed(RaygraphError):
    """Training could not go on: no step updated the policy, or recovery gave up."""


class BadConfig(ConfigInvalid, ValueError):
    """A setting that cannot be honoured (found after the schema's checks, e.g. against this machine)."""


class BadData(DataInvalid, ValueError):
    """Data, a tokenizer or a built asset that does not fit the config."""


class MissingInput(DataInvalid, FileNotFoundError):
    """A file or directory the config names does not exist."""


class MissingColumn(ConfigInvalid, KeyError):
    """A step needs a batch column that no earlier step of the workflow's graph made (a method not
    bound, or bound in the wrong order); the message names the column and what the batch has."""

    def __str__(self) -> str:   # KeyError would quote the message
        return str(self.args[0]) if self.args else ""
