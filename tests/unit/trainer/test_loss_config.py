"""The loss's off-policy correction as a user configures it: the example under configs/ and refused combinations."""

from pathlib import Path

import pytest

from contracts.config import ConfigError, parse_config
from launch.rl_config import RLConfig, resolve_shared
from trainer.config import TrainerConfig

DEBUG = Path(__file__).parents[3] / "configs" / "debug" / "rl"


def test_off_policy_example_layers_over_the_debug_run():
    files = ["--trainer", "@", str(DEBUG / "train.toml"), "--trainer", "@", str(DEBUG / "off-policy.toml")]
    files += ["--orchestrator", "@", str(DEBUG / "orch.toml"), "--inference", "@", str(DEBUG / "infer.toml")]
    trainer = resolve_shared(parse_config(RLConfig, files)).trainer
    assert (trainer.loss.correction, trainer.loss.correction_low, trainer.loss.correction_high) == (
        "token_truncate", 0.0, 2.0,
    )  # fmt: skip
    assert (trainer.loss.bound, trainer.loss.mask_low, trainer.loss.mask_high) == ("mask", 0.125, 8.0)
    assert (trainer.max_steps, trainer.optim.lr) == (20, 3e-3)  # train.toml's keys stay


def test_a_correction_with_ppo_clipping_is_refused_in_one_line_naming_the_file(tmp_path):
    train = tmp_path / "train.toml"
    train.write_text('[loss]\ncorrection = "sequence_mask"\nbound = "clip"\n')
    with pytest.raises(ConfigError) as error:
        parse_config(TrainerConfig, ["@", str(train)])
    assert str(error.value) == (
        f"{train}: loss: correction = 'sequence_mask' replaces the ratio that bound = 'clip' would clip by its own "
        "weight: use bound = 'mask' (or correction = 'none')"
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--loss.correction", "token_clip"], r"^--loss.correction: loss.correction: Input should be 'none', "),
        (["--loss.correction-high", "0.5"], r"^--loss.correction-high: loss.correction_high: .*greater than or equal"),
        (["--loss.correction-low", "2"], r"^--loss.correction-low: loss.correction_low: .*less than or equal to 1"),
    ],
)
def test_bad_correction_values_name_their_key(flags, message):
    with pytest.raises(ConfigError, match=message) as error:
        parse_config(TrainerConfig, flags)
    assert "\n" not in str(error.value)
