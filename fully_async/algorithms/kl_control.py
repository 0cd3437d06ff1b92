"""The in-reward KL coefficient (algorithm.kl_ctrl), as verl's core_algos controllers.

`fixed` keeps algorithm.kl_ctrl.kl_coef.  `adaptive` is the controller of Ziegler et al. 2019
(arXiv:1909.08593) exactly as verl implements it: after each step, with `current_kl` the batch mean of the
per-response mean KL and `n_steps` the step's responses,

    error = clip(current_kl / target_kl - 1, -0.2, 0.2);   coef *= 1 + error * n_steps / horizon

The step uses the coefficient before its update, as verl's apply_kl_penalty does.
"""
from __future__ import annotations

from typing import Any


class FixedKLController:
    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """A fixed coefficient never moves."""


class AdaptiveKLController:
    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon


def build_kl_controller(kl_ctrl: Any) -> FixedKLController | AdaptiveKLController:
    """The controller algorithm.kl_ctrl describes (type fixed | adaptive)."""
    if kl_ctrl.type == "fixed":
        return FixedKLController(kl_ctrl.kl_coef)
    if kl_ctrl.type == "adaptive":
        return AdaptiveKLController(kl_ctrl.kl_coef, kl_ctrl.target_kl, kl_ctrl.horizon)
    raise ValueError(f"algorithm.kl_ctrl.type={kl_ctrl.type!r} is not one of ['fixed', 'adaptive']")
