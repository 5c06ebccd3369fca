"""KL-penalty coefficient controllers (Ziegler et al. 2019, "Fine-Tuning Language Models from
Human Preferences", sec. 2.2).

A controller holds the current coefficient `value` (beta) of the KL penalty
`r_t - beta * KL_t`; the trainer reads `.value` each step and calls `.update(kl, n_steps)`
with the measured KL. Both controllers save and restore their state for checkpoint resume.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["AdaptiveKLController", "FixedKLController", "KLController", "make_kl_controller"]


class KLController(Protocol):
    """What the trainer relies on; both controllers satisfy it."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class FixedKLController:
    """A constant coefficient.

    Args:
        coef: the KL coefficient beta (>= 0).
    """

    def __init__(self, coef: float) -> None:
        if coef < 0:
            raise ValueError(f"KL coef must be >= 0, got {coef}")
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient never changes."""

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional controller steering the measured KL towards `target` (Ziegler et al. 2019, sec. 2.2):

        e_t = clip(KL_t / target - 1, -0.2, 0.2)
        beta_{t+1} = beta_t * (1 + e_t * n_steps / horizon)

    Args:
        init_coef: starting beta (> 0; a zero beta could never grow).
        target: target KL per sequence (or per token, as the caller measures it), > 0.
        horizon: number of samples over which the error is corrected, > 0.
    """

    ERROR_CLIP = 0.2

    def __init__(self, init_coef: float, target: float, horizon: int) -> None:
        if init_coef <= 0 or target <= 0 or horizon <= 0:
            raise ValueError(
                f"adaptive KL needs init_coef, target and horizon > 0, got {init_coef}, {target}, {horizon}"
            )
        self.value = float(init_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move `value` by the clipped proportional error.

        Args:
            current_kl: the KL measured on the latest batch.
            n_steps: the number of samples (or steps) that batch represents.
        """
        error = min(max(float(current_kl) / self.target - 1.0, -self.ERROR_CLIP), self.ERROR_CLIP)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


def make_kl_controller(
    kind: str, coef: float, target: float | None = None, horizon: int | None = None
) -> FixedKLController | AdaptiveKLController:
    """Build a controller from flat arguments (what a config builder passes).

    Args:
        kind: "fixed" or "adaptive".
        coef: the (initial) coefficient.
        target, horizon: required for "adaptive", ignored for "fixed".

    Raises:
        ValueError: unknown `kind` or a missing argument for "adaptive".
    """
    if kind == "fixed":
        return FixedKLController(coef)
    if kind == "adaptive":
        missing = [name for name, v in (("target", target), ("horizon", horizon)) if v is None]
        if missing:
            raise ValueError(f"adaptive KL controller needs {' and '.join(missing)}")
        return AdaptiveKLController(coef, target, horizon)
    raise ValueError(f"unknown KL controller kind {kind!r}; valid kinds: adaptive, fixed")
