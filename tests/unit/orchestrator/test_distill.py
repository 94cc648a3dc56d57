"""On-policy distillation, orchestrator side: the teacher's prompt logprobs read from vLLM-shaped answers, each sampled
token's advantage ``coef * (teacher - sampled logprob)`` in the batch files beside a GRPO environment's group-relative
ones, the reverse KL logged per environment, and the config refusals, one line each."""

import asyncio
import json

import httpx
import pytest
from rollouts import rollout, sampled

import orchestrator.loop.groups as groups_module
from contracts.config import ConfigError, parse_config
from contracts.errors import TridentError
from contracts.metrics import read_metrics
from contracts.protocol import read_batch, write_batch
from orchestrator.batching.batch import assemble_batch
from orchestrator.batching.distill import reverse_kl_metrics
from orchestrator.config import AdvantageConfig, OrchestratorConfig, TeacherConfig
from orchestrator.loop.run import Orchestrator
from orchestrator.serving.teacher import TOKENIZE, Teacher

# an opd rollout: two prompt tokens, then 7 and 8 sampled with logprobs -1.0 and -2.0
OPD_TOKENS, OPD_SAMPLED = [5, 6, 7, 8], [-1.0, -2.0]
# what the teacher's server gives each token after the first (and another, higher-ranked token beside it)
TEACHER = {6: -0.5, 7: -0.25, 8: -3.0}


def vllm_answer(token_ids: list[int]) -> dict:
    """A ``/v1/completions`` answer with ``prompt_logprobs = 0`` as vLLM 0.32 writes it: None for the first token,
    then the prompt token's own entry (and here a top token beside it, which must not be read)."""
    entries = [None] + [
        {str(t): {"logprob": TEACHER[t], "rank": 2, "decoded_token": "x"},
         "99": {"logprob": -0.01, "rank": 1, "decoded_token": "y"}}
        for t in token_ids[1:]
    ]  # fmt: skip
    return {"choices": [{"index": 0, "text": "z", "prompt_logprobs": entries}]}


def fake_teacher(tokenize: list[int] | None = None) -> tuple[Teacher, list[dict]]:
    """A :class:`Teacher` whose server answers as vLLM does, and the requests it got."""
    requests: list[dict] = []

    def answer(request: httpx.Request) -> httpx.Response:
        requests.append({"path": request.url.path, **json.loads(request.content)})
        if request.url.path == TOKENIZE:
            return httpx.Response(200, json={"count": 3, "max_model_len": 99, "tokens": tokenize or [1, 2, 3]})
        return httpx.Response(200, json=vllm_answer(requests[-1]["prompt"]))

    teacher = Teacher(TeacherConfig(base_url="http://teacher:8001/v1", model="big", coef=0.5), "http://student:8000")
    teacher.http = httpx.AsyncClient(base_url="http://teacher:8001", transport=httpx.MockTransport(answer))
    return teacher, requests


def test_hand_computed_advantages_of_an_opd_env_beside_a_grpo_env_in_one_batch(tmp_path):
    """coef 0.5: token 7's advantage is 0.5 * (-0.25 - -1.0) = 0.375, token 8's 0.5 * (-3.0 - -2.0) = -0.5, the prompt
    tokens' 0; the GRPO group (rewards 1 and 0, mean baseline) keeps 0.5 and -0.5 on every token. The opd sample's
    summary advantage is its tokens' mean, -0.0625, and reverse_kl/chat the mean of sampled - teacher over its
    sampled tokens: ((-1.0 + 0.25) + (-2.0 + 3.0)) / 2 = 0.125; the math env logs none."""
    teacher, requests = fake_teacher()
    grpo = [rollout(1.0, sampled([1, 2, 3], 2, [-0.1]), env="math"),
            rollout(0.0, sampled([1, 2, 4], 2, [-0.2]), env="math")]  # fmt: skip
    opd = [rollout(0.0, sampled(OPD_TOKENS, 2, OPD_SAMPLED), env="chat", algorithm="opd")]
    asyncio.run(teacher.score([opd]))
    assert requests == [{"path": "/v1/completions", "model": "big", "prompt": OPD_TOKENS, "max_tokens": 1,
                         "prompt_logprobs": 0, "temperature": 1.0}]  # fmt: skip
    assert opd[0].branches[0].teacher_logprobs == [0.0, -0.5, -0.25, -3.0]

    batch = assemble_batch(1, [grpo, opd], 0, seq_len=16, distill_coef=0.5)
    write_batch(tmp_path, batch.info(1, 1.0, 0.0, {}), batch.micro_batches)
    _, micro_batches = read_batch(tmp_path, 1)
    by_first_tokens = {tuple(s.input_ids.tolist()): s.advantages.tolist() for m in micro_batches for s in m.samples()}
    assert by_first_tokens == {
        (5, 6, 7, 8): [0.0, 0.0, 0.375, -0.5],
        (1, 2, 3): [0.5, 0.5, 0.5],
        (1, 2, 4): [-0.5, -0.5, -0.5],
    }
    assert batch.advantages == [[0.5, -0.5], [-0.0625]]
    assert [(s.advantage, s.meta.get("algorithm")) for s in batch.samples if s.meta["env"] == "chat"] == [
        (-0.0625, "opd")
    ]
    assert [s.meta.get("algorithm") for s in batch.samples if s.meta["env"] == "math"] == [None, None]
    assert reverse_kl_metrics(batch.groups) == {"reverse_kl/chat": 0.125}


def test_an_opd_group_that_ties_is_kept_where_tying_grpo_groups_are_dropped():
    """drop_uniform_groups leaves out a GRPO group whose rewards all tie (zero advantage), never a distilled one: its
    signal is the teacher's, whatever the rewards."""
    teacher, _ = fake_teacher()
    opd = [rollout(1.0, sampled(OPD_TOKENS, 2, OPD_SAMPLED), env="chat") for _ in range(2)]
    tied = [rollout(1.0, sampled([1, 2, 3], 2, [-0.1]), env="math") for _ in range(2)]
    varied = [rollout(float(r), sampled([1, 2, 4], 2, [-0.1]), env="math") for r in (0, 1)]
    asyncio.run(teacher.score([opd]))
    batch = assemble_batch(1, [tied, opd, varied], 0, 16, AdvantageConfig(drop_uniform_groups=True), distill_coef=0.5)
    assert sorted(s.token_ids for s in batch.samples) == [[1, 2, 4], [1, 2, 4], OPD_TOKENS, OPD_TOKENS]


def test_a_teacher_with_another_tokenizer_is_refused_in_one_line():
    teacher, requests = fake_teacher(tokenize=[1, 2, 3])

    def student_tokens(tokens: list[int]) -> httpx.AsyncClient:
        reply = httpx.Response(200, json={"count": 3, "max_model_len": 99, "tokens": tokens})
        return httpx.AsyncClient(base_url="http://student:8000", transport=httpx.MockTransport(lambda _: reply))

    asyncio.run(teacher.check_tokenizer(student_tokens([1, 2, 3]), "small"))
    assert requests[0]["path"] == TOKENIZE and requests[0]["model"] == "big"
    with pytest.raises(TridentError) as refused:
        asyncio.run(teacher.check_tokenizer(student_tokens([1, 2, 4]), "small"))
    assert str(refused.value) == (
        "teacher.model = 'big' tokenizes text into other ids than the student 'small' (a fixed text's /tokenize on "
        "both servers): distillation needs the same tokenizer"
    )


def config_error(tmp_path, toml: str, *flags: str) -> str:
    """The one line :func:`parse_config` refuses orch.toml ``toml`` (with ``flags``) with."""
    (tmp_path / "orch.toml").write_text(toml)
    with pytest.raises(ConfigError) as refused:
        parse_config(OrchestratorConfig, ["@", str(tmp_path / "orch.toml"), *flags])
    assert "\n" not in str(refused.value)
    return str(refused.value)


TEACHER_TABLE = '[teacher]\nbase_url = "http://127.0.0.1:8001/v1"\nmodel = "big"\n'
TWO_ENVS = '[[env]]\nid = "reverse-text"\n[[env]]\nid = "char-target"\nalgorithm = "grpo"\n'


def test_an_env_inherits_the_runs_algorithm_unless_it_names_its_own(tmp_path):
    (tmp_path / "orch.toml").write_text('algorithm = "opd"\n' + TEACHER_TABLE + TWO_ENVS)
    config = parse_config(OrchestratorConfig, ["@", str(tmp_path / "orch.toml")])
    assert [config.env_algorithm(0), config.env_algorithm(1)] == ["opd", "grpo"]
    assert config.teacher.base_url == "http://127.0.0.1:8001"
    assert OrchestratorConfig().env_algorithm(0) == "grpo"


def test_opd_without_a_teacher_is_refused_in_one_line(tmp_path):
    line = config_error(tmp_path, 'algorithm = "opd"\n')
    assert line.endswith("env.0 ('reverse-text') uses algorithm 'opd' with no [teacher] table"), line


def test_a_teacher_that_is_the_live_policy_is_refused_in_one_line(tmp_path):
    model = OrchestratorConfig().model.name
    table = f'algorithm = "opd"\n[teacher]\nbase_url = "http://127.0.0.1:8000/v1/"\nmodel = "{model}"\n'
    line = config_error(tmp_path, table)
    assert line.endswith(
        f"teacher.base_url = 'http://127.0.0.1:8000' with teacher.model = '{model}' is the live policy "
        "(client.base_url, model.name): it would distil the policy into itself"
    ), line
    (tmp_path / "orch.toml").write_text(table.replace("8000", "8001"))  # another server: a teacher
    assert parse_config(OrchestratorConfig, ["@", str(tmp_path / "orch.toml")]).teacher.model == model


def test_an_algorithm_on_an_eval_env_is_refused_in_one_line(tmp_path):
    line = config_error(tmp_path, '[eval]\n[[eval.env]]\nid = "reverse-text"\nalgorithm = "opd"\n')
    assert line.endswith(
        "env.0 ('reverse-text') names algorithm = 'opd': evaluation scores rollouts and trains none; "
        "leave algorithm out"
    ), line


def test_one_rollout_per_example_is_refused_with_a_grpo_env_only(tmp_path):
    line = config_error(tmp_path, 'algorithm = "opd"\nrollouts_per_example = 1\n' + TEACHER_TABLE + TWO_ENVS)
    assert "rollouts_per_example = 1 with advantage.baseline = 'mean': the baseline is the group's own reward" in line
    (tmp_path / "orch.toml").write_text('algorithm = "opd"\nrollouts_per_example = 1\n' + TEACHER_TABLE)
    assert parse_config(OrchestratorConfig, ["@", str(tmp_path / "orch.toml")]).rollouts_per_example == 1


def test_a_step_distils_its_opd_env_and_keeps_grpo_on_the_other(tmp_path, monkeypatch):
    """One orchestrator step with two environments, env 0 on opd and env 1 on grpo (a fake teacher, hand-made
    rollouts in place of the server): the opd env's batch tokens carry 0.5 * (teacher - sampled), the grpo env's the
    group's advantage, and the step logs reverse_kl for the opd env alone."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    table = {"base_url": "http://teacher:8001", "model": "big", "coef": 0.5}
    config = OrchestratorConfig(output_dir=tmp_path, batch_size=2, rollouts_per_example=2, teacher=table,
                                env=[{"id": "reverse-text", "algorithm": "opd"}, {"id": "char-target"}])  # fmt: skip
    orchestrator = Orchestrator(config)
    served = httpx.MockTransport(lambda request: httpx.Response(200, json={"step": 0, "path": "/b", "adapter": None}))
    orchestrator.servers.servers[0].client.http = httpx.AsyncClient(base_url="http://server", transport=served)
    orchestrator.teacher, _ = fake_teacher()

    async def run_group(env, task, n, ctx, limit, output_dir):
        name = "chat" if env is orchestrator.envs[0] else "math"
        tokens, logprobs = (OPD_TOKENS, OPD_SAMPLED) if name == "chat" else ([1, 2, 3], [-0.1])
        return [rollout(float(i), sampled(tokens, 2, logprobs), env=name, turns=1) for i in range(n)]

    monkeypatch.setattr(groups_module, "run_group", run_group)
    asyncio.run(orchestrator.step(1))
    orchestrator.metrics.close()
    _, micro_batches = read_batch(tmp_path, 1)
    advantages = sorted(s.advantages.tolist() for m in micro_batches for s in m.samples())
    assert advantages == [[-0.5] * 3, [0.0, 0.0, 0.375, -0.5], [0.0, 0.0, 0.375, -0.5], [0.5] * 3]
    (record,) = read_metrics(tmp_path, "orchestrator")
    assert record["reverse_kl/chat"] == 0.125 and not any(k.startswith("reverse_kl/math") for k in record)


def test_a_teacher_server_that_does_not_answer_is_one_line(free_port):
    teacher = Teacher(TeacherConfig(base_url=f"http://127.0.0.1:{free_port()}/v1", model="big"), "http://student:8000")
    with pytest.raises(TridentError, match=r"^teacher.base_url = 'http://127.0.0.1:\d+' did not answer") as refused:
        asyncio.run(teacher.logprobs([1, 2]))
    assert "\n" not in str(refused.value) and "/v1/completions" in str(refused.value)


def test_one_env_id_on_two_algorithms_is_refused_in_one_line(tmp_path):
    """Metrics are logged by environment id: the same id on opd and grpo would mix the two in one curve."""
    same_id = TWO_ENVS.replace('"char-target"', '"reverse-text"')
    line = config_error(tmp_path, 'algorithm = "opd"\n' + TEACHER_TABLE + same_id)
    assert line.endswith(
        "env.0 and env.1 ('reverse-text') train on 'opd' and 'grpo': an environment's metrics are logged under its "
        "id, so the two would mix; train one algorithm per environment id"
    ), line
    (tmp_path / "orch.toml").write_text('algorithm = "opd"\n' + TEACHER_TABLE + same_id.replace('"grpo"', '"opd"'))
    assert len(parse_config(OrchestratorConfig, ["@", str(tmp_path / "orch.toml")]).env) == 2  # one algorithm: kept
