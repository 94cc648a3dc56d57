"""Each sampled token's weights step rides the completion's logprobs list from the server's answer into the rollout
graph (orchestrator.verifiers_adapter.weight_steps)."""

from orchestrator.verifiers_adapter.weight_steps import node_weight_steps, parse_completion_logprobs


def choice(weight_versions=None) -> dict:
    content = [{"token": f"token_id:{i}", "token_id": i, "logprob": -float(i)} for i in (4, 5, 6)]
    return {"token_ids": [4, 5, 6], "logprobs": {"content": content}, "weight_versions": weight_versions}


def test_the_logprobs_carry_the_step_of_each_token_when_the_server_labelled_them():
    spans = [{"version": "2", "start": 0, "end": 1}, {"version": "3", "start": 1, "end": 3}]
    logprobs = parse_completion_logprobs(choice(spans), [4, 5, 6])
    assert logprobs == [-4.0, -5.0, -6.0]  # renderers' own parse, unchanged
    assert node_weight_steps(logprobs) == [2, 3, 3]
    # unlabelled (another server), or labels that are not steps: no steps, the orchestrator's own bound stands
    assert node_weight_steps(parse_completion_logprobs(choice(), [4, 5, 6])) is None
    assert node_weight_steps(parse_completion_logprobs(choice([{"version": "default", "start": 0, "end": 3}]),
                                                       [4, 5, 6])) is None  # fmt: skip
