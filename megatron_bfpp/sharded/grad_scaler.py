"""Loss scalers with Megatron's semantics and state-dict format, on any device.

Megatron's `megatron.core.optimizer.grad_scaler` allocates its tensors on CUDA unconditionally; these are
the same algorithms (constant scale; dynamic scale with growth interval and hysteresis) on the device of
the model.
"""

from __future__ import annotations

import torch


class ConstantGradScaler:
    def __init__(self, scale: float, device: torch.device | str = "cpu") -> None:
        self._scale = torch.tensor([float(scale)], dtype=torch.float32, device=device)

    @property
    def scale(self) -> torch.Tensor:
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        return self._scale.double().reciprocal().float()

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass


class DynamicGradScaler(ConstantGradScaler):
    """Halve (backoff) after `hysteresis` consecutive overflowing steps, double (growth) after
    `growth_interval` consecutive clean ones; never below `min_scale`."""

    def __init__(
        self,
        initial_scale: float,
        min_scale: float,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        device: torch.device | str = "cpu",
    ) -> None:
        if not 0.0 < min_scale <= initial_scale:
            raise ValueError(f"--min-loss-scale must be in (0, --initial-loss-scale] (got {min_scale}, {initial_scale})")
        if growth_factor <= 1.0 or not 0.0 < backoff_factor < 1.0:
            raise ValueError("loss scale growth factor must be > 1 and backoff factor in (0, 1)")
        if growth_interval < 1 or hysteresis < 1:
            raise ValueError("--loss-scale-window and --hysteresis must be >= 1")
        super().__init__(initial_scale, device)
        self.min_scale = float(min_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = torch.clamp(self._scale * self.backoff_factor, min=self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale = self._scale * self.growth_factor

    def state_dict(self) -> dict:
        return {
            "scale": self._scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        self._scale = state_dict["scale"].to(self._scale.device)
        self._growth_tracker = state_dict["growth_tracker"]
        self._hysteresis_tracker = state_dict["hysteresis_tracker"]


def make_grad_scaler(config, device: torch.device | str) -> ConstantGradScaler | None:
    """The scaler Megatron's optimizer factory would build for this OptimizerConfig (None: no scaling)."""
    loss_scale = getattr(config, "loss_scale", None)
    if getattr(config, "fp16", False):
        if loss_scale:
            return ConstantGradScaler(loss_scale, device)
        return DynamicGradScaler(
            initial_scale=config.initial_loss_scale,
            min_scale=config.min_loss_scale,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=config.loss_scale_window,
            hysteresis=config.hysteresis,
            device=device,
        )
    if loss_scale:
        return ConstantGradScaler(loss_scale, device)
    return None
