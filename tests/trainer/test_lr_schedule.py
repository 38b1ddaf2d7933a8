"""The learning-rate schedule (actor.optim): warmup by steps or by ratio, verl's -1 included."""

import pytest
import torch

from verl_agent.config import OptimConfig
from verl_agent.trainer.policy.fsdp import make_scheduler


@pytest.mark.parametrize("steps, ratio, ramp", [(4, 0.0, 4), (0, 0.1, 10), (-1, 0.1, 10), (4, 0.5, 4)])
def test_warmup_by_steps_or_by_ratio(steps, ratio, ramp):
    """lr_warmup_steps > 0 wins; 0 or verl's default -1 hands over to lr_warmup_steps_ratio of the total."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = make_scheduler(opt, OptimConfig(lr=1.0, lr_warmup_steps=steps, lr_warmup_steps_ratio=ratio), 100)
    lrs = []
    for _ in range(ramp + 2):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[:ramp] == pytest.approx([(i + 1) / ramp for i in range(ramp)]) and lrs[ramp:] == [1.0, 1.0]
