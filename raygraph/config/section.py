"""The base of every config section: unknown keys are errors, values are frozen."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["Section"]


class Section(BaseModel):
    """A config section (`cfg.model_copy(update=...)` derives a changed copy)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
