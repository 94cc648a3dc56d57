"""Why a rollout trains nothing: each reason provoked with hand-made rollouts, the step's error naming it with its
count and most common causes, and the step's metrics counting it when other rollouts train."""

import pytest
from rollouts import masked, rollout, sampled

from contracts.errors import TridentError
from orchestrator.batching.batch import assemble_batch
from orchestrator.batching.no_sample import no_sample_metrics
from orchestrator.config import AdvantageConfig

TRAINS = sampled([1, 2, 3], 1, [-1.0, -1.0])  # a prompt token, then two sampled: 3 tokens
LONG = sampled([1] * 20, 1, [-1.0] * 19)  # longer than the seq_len of 16 used here
PREFIX = "step 3: no rollout produced a training sample: "
KEPT = "; each failed rollout's full error is in the run's metrics/failed_rollouts.jsonl"


def step_error(groups, seq_len: int = 16, **options) -> str:
    with pytest.raises(TridentError) as error:
        assemble_batch(3, groups, 0, seq_len, **options)
    return str(error.value)


def test_failed_rollouts_are_counted_by_cause_each_with_where_it_was_first():
    unauthorized = "ProviderError: Error code: 401 - unauthorized"
    groups = [
        [rollout(0.0, ok=False, error="TaskError: no data", env="code", task="t0"),
         rollout(0.0, ok=False, error=unauthorized, env="code", task="t1")],
        [rollout(0.0, ok=False, error=unauthorized + "\n  at the interception server", env="code", task="t2"),
         rollout(0.0, ok=False, error=unauthorized, env="code", task="t2")],
    ]  # fmt: skip
    assert step_error(groups) == (
        PREFIX + "4 failed (ProviderError: Error code: 401 - unauthorized ×3, first in environment 'code' (task t1); "
        "TaskError: no data ×1, first in environment 'code' (task t0))" + KEPT
    )


def failing(errors: list[str]) -> list:
    return [rollout(0.0, ok=False, error=error, env="swe", task=str(i)) for i, error in enumerate(errors)]


def test_one_cause_with_per_rollout_text_counts_once_and_names_the_real_cause():
    # the run: 64 rollouts, each cloning into its own temporary folder; counted by first line, it read
    # "×1 …; 63 with other errors", and the cut first line dropped git's error
    git = "fatal: could not read Username for 'https://github.com': No such device or address"
    one_line = failing([f"HarnessError: git clone failed in /tmp/tmp{i:08x}: {git}" for i in range(64)])
    assert step_error([one_line]) == (
        PREFIX + f"64 failed (HarnessError: git clone failed in /tmp/tmp00000000: {git} ×64, first in environment "
        "'swe' (task 0))" + KEPT
    )
    git = "fatal: unable to access 'https://github.com/o/r.git/': Could not resolve host"
    cloning = failing([f"HarnessError: harness 'bash' exited 128: Cloning into '/tmp/tmp{i:08x}/repo'...\n{git} "
                       f"(after {i / 10}s)\n" for i in range(64)])  # fmt: skip
    assert step_error([cloning]) == (
        PREFIX + f"64 failed (HarnessError: {git} (after 0.0s) ×64, first in environment 'swe' (task 0))" + KEPT
    )


def test_the_step_error_names_three_causes_and_counts_the_rest():
    errors = ["TaskError: a", "TaskError: b", "TaskError: b", "TaskError: c", "TaskError: d", "TaskError: e"]
    failed = [rollout(0.0, ok=False, error=e, env="code", task=f"t{i}") for i, e in enumerate(errors)]
    assert step_error([failed]) == (
        PREFIX + "6 failed (TaskError: b ×2, first in environment 'code' (task t1); TaskError: a ×1, first in "
        "environment 'code' (task t0); TaskError: c ×1, first in environment 'code' (task t3); 2 with 2 other causes)"
        + KEPT
    )


def test_groups_lost_to_infrastructure_errors():
    lost = [rollout(0.0, ok=False, error="SandboxError: gone", lost=True, env="code", task="t4"), rollout(1.0, TRAINS)]
    assert step_error([lost]) == (
        PREFIX + "2 in groups lost to infrastructure errors (SandboxError: gone ×1, first in environment 'code' "
        "(task t4))" + KEPT
    )


def test_samples_longer_than_seq_len():
    groups = [[rollout(1.0, TRAINS), rollout(0.0, TRAINS)]]
    assert step_error(groups, seq_len=2) == PREFIX + "2 longer than seq_len = 2"


def test_truncated_rollouts_masked_as_asked():
    groups = [[rollout(1.0, TRAINS, truncated=True), rollout(0.0, TRAINS, truncated=True)]]
    assert step_error(groups, mask_truncated=True) == PREFIX + "2 truncated and masked (mask_truncated_completions)"
    assert assemble_batch(3, groups, 0, 16).untrained == []  # unmasked, they train


def test_finished_rollouts_that_sampled_no_token_are_not_called_too_long():
    # the two-seat run: every rollout finished without an error of its own yet sampled nothing, its model
    # call refused; the step said "all longer than seq_len = 1024"
    silent = [rollout(0.0, env="self-play", task="7", error="InterceptionError: unauthorized request")] * 2
    assert step_error([silent], seq_len=1024) == (
        PREFIX + "2 with no trainable token (InterceptionError: unauthorized request ×2, first in environment "
        "'self-play' (task 7); 2 made no model call)"
    )
    all_prompt = [rollout(1.0, masked("..."), turns=1), rollout(0.0, masked(".."), turns=1)]  # nothing sampled
    assert step_error([all_prompt]) == PREFIX + "2 with no trainable token"


def test_tied_groups_left_out_with_the_other_reasons_in_order():
    tied = [rollout(1.0, TRAINS), rollout(1.0, TRAINS)]
    split = [rollout(1.0, LONG), rollout(0.0, ok=False, error="boom", env="code", task="t9")]
    error = step_error([tied, split], advantage=AdvantageConfig(drop_uniform_groups=True))
    assert error == (
        PREFIX + "1 failed (boom ×1, first in environment 'code' (task t9)), 2 in groups whose rewards all tie "
        "(advantage.drop_uniform_groups or filter.refill), 1 longer than seq_len = 16" + KEPT
    )


def test_a_step_that_trains_counts_what_gave_nothing():
    good = [rollout(1.0, TRAINS), rollout(0.0, TRAINS)]
    too_long = [rollout(1.0, TRAINS), rollout(0.5, LONG)]
    nothing_sampled = [rollout(0.0, masked("..")), rollout(1.0, TRAINS)]
    masked_truncated = [rollout(0.0, TRAINS, truncated=True), rollout(1.0, TRAINS)]
    failed = [rollout(0.0, ok=False, error="HarnessError: exit 1"), rollout(1.0, TRAINS)]
    lost = [rollout(0.0, ok=False, error="SandboxError: gone", lost=True), rollout(1.0, TRAINS)]
    groups = [good, too_long, nothing_sampled, masked_truncated, failed, lost]
    batch = assemble_batch(1, groups, 0, seq_len=16, mask_truncated=True)
    assert sorted(u.reason for u in batch.untrained) == [
        "failed", "lost", "lost", "no_trainable_token", "too_long", "truncated_masked"
    ]  # fmt: skip
    assert no_sample_metrics(batch.untrained) == {
        "no_sample/lost": 2,
        "no_sample/tied": 0,
        "no_sample/too_long": 1,
        "no_sample/truncated_masked": 1,
        "no_sample/no_trainable_token": 1,
    }
    assert batch.overlong == 1 and len(batch.samples) == 8  # the nothing-sampled and masked ones among them


def test_a_rollout_with_one_trained_sample_trains():
    forked = rollout(1.0, LONG, TRAINS)  # its first branch too long, its second fits
    batch = assemble_batch(1, [[forked, rollout(0.0, TRAINS)]], 0, seq_len=16)
    assert batch.untrained == [] and batch.overlong == 1
