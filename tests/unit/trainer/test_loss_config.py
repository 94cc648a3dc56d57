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


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        (
            '[loss]\nbound = "cispo"\ncorrection = "token_truncate"\n',
            "loss: correction = 'token_truncate' replaces the ratio that bound = 'cispo' would clip by its own weight: "
            "use bound = 'mask' (or correction = 'none')",
        ),
        (
            '[loss]\nbound = "dppo"\nratio = "sequence"\n',
            "loss: bound = 'dppo' masks each token by its own probability change: use ratio = 'token' with it",
        ),
        (
            '[loss]\ncustom = "math:dist"\nbound = "sapo"\nratio = "sequence"\n',
            None,  # math.dist takes no such arguments: the import path is refused first
        ),
    ],
)
def test_policy_terms_that_cannot_combine_are_refused_in_one_line(tmp_path, toml, message):
    train = tmp_path / "train.toml"
    train.write_text(toml)
    with pytest.raises(ConfigError) as error:
        parse_config(TrainerConfig, ["@", str(train)])
    assert "\n" not in str(error.value)
    if message is not None:
        assert str(error.value) == f"{train}: {message}"


def test_a_custom_term_replaces_ratio_bound_and_correction(tmp_path, monkeypatch):
    arguments = "logprobs, inference_logprobs, advantages, loss_mask, sample_lengths"
    (tmp_path / "my_term.py").write_text(f"def term({arguments}):\n    return -advantages * logprobs\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert parse_config(TrainerConfig, ["--loss.custom", "my_term:term"]).loss.custom == "my_term:term"
    with pytest.raises(ConfigError) as error:
        parse_config(
            TrainerConfig, ["--loss.custom", "my_term:term", "--loss.bound", "clip", "--loss.ratio", "sequence"]
        )
    assert str(error.value).endswith(
        ": loss: custom = 'my_term:term' computes the policy term itself: drop ratio = 'sequence' and bound = 'clip'"
    )


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("no_such_package.terms:term", "importing no_such_package.terms failed: ModuleNotFoundError: No module named"),
        ("math:no_such_function", "math has no function no_such_function"),
        ("math.sqrt", "not 'package.module:function'"),
        ("math:sqrt", "sqrt must take the keyword arguments logprobs, inference_logprobs, advantages, loss_mask, "),
    ],
)
def test_a_bad_custom_path_is_one_line_naming_the_key_and_value(tmp_path, path, reason):
    train = tmp_path / "train.toml"
    train.write_text(f'[loss]\ncustom = "{path}"\n')
    with pytest.raises(ConfigError) as error:
        parse_config(TrainerConfig, ["@", str(train)])
    assert str(error.value).startswith(f"{train}: loss.custom: '{path}': ")
    assert reason in str(error.value) and "\n" not in str(error.value)
