import math

import pytest

from trainer.config import OptimConfig
from trainer.optim import lr_factor


def factors(max_steps=6, **optim):
    return [lr_factor(step, max_steps, OptimConfig(**optim)) for step in range(max_steps)]


def test_constant_with_warmup_rises_linearly_then_holds():
    assert factors(warmup_steps=2) == pytest.approx([1 / 3, 2 / 3, 1, 1, 1, 1])


def test_linear_and_cosine_decay_to_min_lr_ratio_at_the_last_step():
    assert factors(schedule="linear") == pytest.approx([1, 0.8, 0.6, 0.4, 0.2, 0])
    cosine = factors(schedule="cosine", warmup_steps=1, min_lr_ratio=0.1)
    assert cosine[0] == pytest.approx(0.5) and cosine[1] == pytest.approx(1.0) and cosine[-1] == pytest.approx(0.1)
    assert cosine[3] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
