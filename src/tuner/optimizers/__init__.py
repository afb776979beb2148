"""Optimizers written here because no maintained package has them: Automagic and AdamW8bitKahan.
`tuner.optimizers.build` names them, with the ones that come from packages."""

from __future__ import annotations

import torch


class PerParameter(torch.optim.Optimizer):
    """An optimizer that updates each parameter on its own (`_step_one(p, group)`), with state in dtypes
    of its own.

    `torch.optim.Optimizer.load_state_dict` casts every state tensor of a floating-point parameter to
    the parameter's dtype: 8-bit codes would become floats and fp32 scales or rates of a bf16 parameter
    would be rounded, so a resumed run would drift from a straight one. This class loads state back as
    saved."""

    def _step_one(self, p: torch.Tensor, group: dict) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._step_one(p, group)
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        for index, saved in state_dict["state"].items():
            param = params[int(index)]
            for key, value in saved.items():
                if torch.is_tensor(value):
                    self.state[param][key] = value.to(param.device, copy=True)
