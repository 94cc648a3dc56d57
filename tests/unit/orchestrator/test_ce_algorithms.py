"""The cross-entropy algorithms, orchestrator side: ECHO's weights on the environment's turns by role (read off the
chat template's rendering of a tool rollout), distillation from a teacher's samples (the teacher's server samples
the environment's groups; its tokens get weight 1 and no policy-gradient term), a step mixing both with GRPO, and the
config refusals, one line each."""

import asyncio
import json
from contextlib import AsyncExitStack
from types import SimpleNamespace

import httpx
import pytest
from rollouts import ONE_SAMPLED, rollout, sampled
from test_distill import config_error
from transformers import AutoTokenizer
from verifiers.v1.configs.client import resolve_api_key

import orchestrator.loop.groups as groups_module
import orchestrator.loop.run as run_module
import orchestrator.loop.workers as workers_module
from contracts.chat_turns import ChatFormat
from contracts.config import parse_config
from contracts.errors import TridentError
from contracts.inference_api import API_KEY_ENV
from contracts.model_card import ModelCard
from contracts.protocol import read_batch
from orchestrator.batching.batch import assemble_batch
from orchestrator.batching.echo import echo_weights
from orchestrator.batching.rollout import Branch
from orchestrator.batching.teacher_samples import set_teacher_sample_weights
from orchestrator.config import AdvantageConfig, EnvConfig, InfraConfig, OrchestratorConfig, SelfDistillConfig
from orchestrator.loop.groups import connect
from orchestrator.loop.run import Orchestrator
from orchestrator.loop.workers import WorkerGroups
from orchestrator.verifiers_adapter.envs import NO_API_KEY_VAR, load_env, tasks_of

QUESTION = "What is 6 * 7?"
CALL = '<tool_call>\n{"name": "calc", "arguments": {"x": "6 * 7"}}\n</tool_call><|im_end|>'
TOOL_RESULT = "<tool_response>\n42\n</tool_response>"


def tool_rollout_tokens(tokenizer) -> tuple[list[int], list[bool]]:
    """A tool rollout as the server sees it (Qwen3's template): a user question, a sampled tool call, the tool's
    answer (in a user turn, as Qwen3 renders it), a sampled answer; the token ids and which were sampled."""
    pieces = [("<|im_start|>user\n" + QUESTION + "<|im_end|>\n<|im_start|>assistant\n", False), (CALL, True),
              ("\n<|im_start|>user\n" + TOOL_RESULT + "<|im_end|>\n<|im_start|>assistant\n", False),
              ("It is 42.<|im_end|>", True)]  # fmt: skip
    ids, mask = [], []
    for text, is_sampled in pieces:
        piece = tokenizer.encode(text, add_special_tokens=False)
        ids, mask = ids + piece, mask + [is_sampled] * len(piece)
    return ids, mask


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


def weighted_text(tokenizer, ids: list[int], weights: list[float]) -> str:
    return tokenizer.decode([t for t, w in zip(ids, weights, strict=True) if w])


def test_echo_weighs_the_content_of_the_turns_of_its_roles_only(tokenizer):
    ids, mask = tool_rollout_tokens(tokenizer)
    chat = ChatFormat.from_tokenizer(tokenizer)
    weights = echo_weights(ids, mask, chat, ["tool"], 0.5)
    assert weighted_text(tokenizer, ids, weights) == TOOL_RESULT  # no header, no <|im_end|>, no sampled token
    assert set(weights) == {0.0, 0.5}
    both = echo_weights(ids, mask, chat, ["tool", "user"], 1.0)
    assert weighted_text(tokenizer, ids, both) == QUESTION + TOOL_RESULT


def test_a_teachers_sample_trains_by_cross_entropy_alone_and_its_tied_group_is_kept():
    """The teacher's sampled tokens get weight 1, the loss mask nothing, the rollout advantage 0 (rewards 0 and 1
    or not); a group of them whose rewards tie is kept where a tied GRPO group is dropped."""
    taught = [rollout(float(r), sampled([5, 6, 7, 8], 2, [-0.5, -0.7]), env="chat") for r in (0, 1)]
    taught_tied = [rollout(1.0, sampled([5, 6, 9], 2, [-0.5]), env="chat") for _ in range(2)]
    tied = [rollout(1.0, sampled([1, 2, 3], 2, [-0.1]), env="math") for _ in range(2)]
    varied = [rollout(float(r), sampled([1, 2, 4], 2, [-0.1]), env="math") for r in (0, 1)]
    set_teacher_sample_weights([taught, taught_tied])
    batch = assemble_batch(1, [tied, taught, taught_tied, varied], 0, 16, AdvantageConfig(drop_uniform_groups=True))
    chat = [s for s in batch.samples if s.meta["env"] == "chat" and len(s.token_ids) == 4]
    assert [(s.ce_weights, s.loss_mask, s.inference_logprobs, s.advantage) for s in chat] == [
        ([0.0, 0.0, 1.0, 1.0], [False] * 4, [0.0] * 4, 0.0)
    ] * 2
    assert chat[0].meta["ce_roles"] == ["assistant"]
    assert sorted(s.token_ids for s in batch.samples) == [[1, 2, 4], [1, 2, 4], [5, 6, 7, 8], [5, 6, 7, 8],
                                                          [5, 6, 9], [5, 6, 9]]  # fmt: skip
    info = batch.info(1, 1.0, 0.0, {})
    assert (info.num_loss_tokens, info.num_ce_tokens) == (2, 6)


def test_a_step_samples_the_sft_env_from_the_teacher_and_weighs_the_echo_envs_tool_turn(tmp_path, monkeypatch,
                                                                                        tokenizer):  # fmt: skip
    """One orchestrator step, env 0 on sft and env 1 on echo (hand-made rollouts in place of the servers): env 0's
    groups go to the teacher's server under its model name, env 1's to the policy's; the batch files carry weight 1
    on the teacher's tokens (no loss token) and on env 1's tool answer beside its group's advantages, and batch.json
    names each sample's algorithm."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    table = {"base_url": "http://teacher:8001", "model": "big"}
    config = OrchestratorConfig(output_dir=tmp_path, batch_size=2, rollouts_per_example=2, teacher=table,
                                env=[{"id": "reverse-text", "algorithm": "sft"},
                                     {"id": "char-target", "algorithm": "echo"}])  # fmt: skip
    orchestrator = Orchestrator(config)
    served = httpx.MockTransport(lambda request: httpx.Response(200, json={"step": 0, "path": "/b", "adapter": None}))
    orchestrator.servers.servers[0].client.http = httpx.AsyncClient(base_url="http://server", transport=served)
    ids, mask = tool_rollout_tokens(tokenizer)
    asked: dict[str, tuple[str, str]] = {}

    async def run_group(env, task, n, ctx, limit, output_dir):
        name = "sft" if env is orchestrator.envs[0] else "echo"
        asked[name] = (ctx.client.base_url, ctx.model)
        logprobs = [-0.5 if m else 0.0 for m in mask]
        return [rollout(float(i), Branch(ids, mask, logprobs), env=name, turns=2) for i in range(n)]

    monkeypatch.setattr(groups_module, "run_group", run_group)
    asyncio.run(orchestrator.step(1))
    orchestrator.metrics.close()
    assert asked["sft"] == ("http://teacher:8001/v1", "big")
    assert asked["echo"][1] == config.model.name and "teacher" not in asked["echo"][0]
    info, micro_batches = read_batch(tmp_path, 1)
    assert {(summary["env"], summary["algorithm"]) for summary in info.samples} == {("sft", "sft"), ("echo", "echo")}
    by_env = {}
    for summary, sample in zip(info.samples, [s for m in micro_batches for s in m.samples()], strict=True):
        by_env.setdefault(summary["env"], []).append(sample)
    for sample in by_env["sft"]:
        assert not sample.loss_mask.any() and sample.ce_weights.bool().tolist() == mask
    for sample in by_env["echo"]:
        assert sample.loss_mask.tolist() == mask and sample.advantages.abs().tolist() == [0.5] * len(ids)
        assert weighted_text(tokenizer, ids, sample.ce_weights.tolist()) == TOOL_RESULT
    assert info.num_ce_tokens == 2 * sum(mask) + 2 * len(tokenizer.encode(TOOL_RESULT))


class InlineWorkers:
    """In place of the rollout workers: each group sent to them run by a worker's :class:`WorkerGroups` here."""

    def __init__(self, config: OrchestratorConfig, env):
        self.groups = WorkerGroups(AsyncExitStack(), config, InfraConfig(), ModelCard.of(config.model.name).path, 1)
        self.groups.env = lambda env_config: asyncio.sleep(0, env)  # loaded already

    async def run_group(self, env_config, task, n, base_url, model, api_key_var):
        return await self.groups.run(env_config, task, n, base_url, model, api_key_var)


@pytest.mark.parametrize("in_workers", [False, True])
@pytest.mark.parametrize(("key_var", "teacher_key"), [(None, "EMPTY"), ("TEACHER_KEY", "teacher-key")])
def test_the_teacher_gets_its_own_key_or_none_never_the_runs(monkeypatch, in_workers, key_var, teacher_key):
    """An sft group samples from the teacher's server with the key in teacher.api_key_var, or with none when it is
    absent (verifiers' placeholder), never the run's TRIDENT_API_KEY, whether the orchestrator or a rollout worker runs
    it; a group run with no algorithm (an evaluation's, even where the run's default is sft) samples from the policy's
    server with the run's key. Each rollout is labelled with its group's algorithm."""
    monkeypatch.setenv(API_KEY_ENV, "policy-key")
    monkeypatch.setenv("TEACHER_KEY", "teacher-key")
    monkeypatch.delenv(NO_API_KEY_VAR, raising=False)  # left set by an earlier test's model context
    env = load_env(EnvConfig(id="reverse-text"))
    task = tasks_of(env)[0]
    teacher = {"base_url": "http://teacher:8001", "model": "big", "api_key_var": key_var}
    config = OrchestratorConfig(algorithm="sft", teacher=teacher)
    runner = connect(config, InfraConfig(), 1)
    sent = []  # (base_url, model, the key its client sends)

    async def run_group(env, task, n, ctx, limits, output_dir):
        sent.append((ctx.client.base_url, ctx.model, resolve_api_key(ctx.client)))
        return [rollout(1.0, ONE_SAMPLED)]

    monkeypatch.setattr(groups_module, "run_group", run_group)
    monkeypatch.setattr(workers_module, "run_group", run_group)
    runner.workers = InlineWorkers(config, env) if in_workers else None

    async def sft_then_eval():
        return await runner.run(env, task, algorithm="sft") + await runner.run(env, task)

    assert [r.algorithm for r in asyncio.run(sft_then_eval())] == ["sft", "grpo"]
    assert sent == [("http://teacher:8001/v1", "big", teacher_key),
                    ("http://127.0.0.1:8000/v1", runner.ctx.model, "policy-key")]  # fmt: skip


TEACHER_TABLE = '[teacher]\nbase_url = "http://127.0.0.1:8001/v1"\nmodel = "big"\n'


def test_sft_without_a_teacher_echo_with_one_rollout_and_echo_on_the_policys_turns_are_refused(tmp_path):
    line = config_error(tmp_path, '[[env]]\nid = "reverse-text"\nalgorithm = "sft"\n')
    assert line.endswith("env.0 ('reverse-text') uses algorithm 'sft' with no [teacher] table"), line
    line = config_error(tmp_path, 'algorithm = "echo"\nrollouts_per_example = 1\n')
    assert "rollouts_per_example = 1 with advantage.baseline = 'mean'" in line
    line = config_error(tmp_path, 'algorithm = "echo"\n[echo]\nroles = ["assistant"]\n')
    assert "echo.roles.0" in line and "'tool', 'user' or 'system'" in line, line
    (tmp_path / "orch.toml").write_text('algorithm = "sft"\nrollouts_per_example = 1\n' + TEACHER_TABLE)
    assert parse_config(OrchestratorConfig, ["@", str(tmp_path / "orch.toml")]).env_algorithm(0) == "sft"


def test_a_step_self_distils_its_opsd_env_on_the_policys_server_shown_the_demonstration(tmp_path, monkeypatch,
                                                                                        tokenizer):  # fmt: skip
    """One orchestrator step, env 0 on opsd (demonstration_key = "text", reverse-text's own field) beside env 1 on
    grpo: each opsd branch goes to the policy's server (its model name) after a system turn showing its task's text;
    its tokens' advantages are 1.0 * (the prefixed server's logprob -0.25 - sampled), the grpo env's its group's;
    batch.json labels the first's samples opsd, the second's not at all. A demonstration_key the task lacks stops the
    step in one line."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    config = OrchestratorConfig(output_dir=tmp_path, batch_size=2, rollouts_per_example=2,
                                self_distill={"demonstration_key": "text", "template": "Shown: {demonstration}"},
                                env=[{"id": "reverse-text", "algorithm": "opsd"}, {"id": "char-target"}])  # fmt: skip
    orchestrator = Orchestrator(config)
    served = httpx.MockTransport(lambda request: httpx.Response(200, json={"step": 0, "path": "/b", "adapter": None}))
    orchestrator.servers.servers[0].client.http = httpx.AsyncClient(base_url="http://server", transport=served)
    requests = []

    def answer(request: httpx.Request) -> httpx.Response:
        requests.append((str(request.url), json.loads(request.content)))
        prompt = requests[-1][1]["prompt"]
        entries = [None] + [{str(t): {"logprob": -0.25 if t in (7, 8) else -9.0, "rank": 1}} for t in prompt[1:]]
        return httpx.Response(200, json={"choices": [{"index": 0, "text": "z", "prompt_logprobs": entries}]})

    orchestrator.self_teacher.http = httpx.AsyncClient(base_url="http://127.0.0.1:8000",
                                                       transport=httpx.MockTransport(answer))  # fmt: skip

    async def run_group(env, task, n, ctx, limit, output_dir):
        name = "opsd" if env is orchestrator.envs[0] else "grpo"
        return [rollout(float(i), sampled([5, 6, 7, 8], 2, [-1.0, -2.0]), env=name, turns=1) for i in range(n)]

    monkeypatch.setattr(groups_module, "run_group", run_group)
    asyncio.run(orchestrator.step(1))
    orchestrator.metrics.close()
    step_tasks = orchestrator.batch_tasks(1)
    texts = [task.data.text for env, task in step_tasks if env is orchestrator.envs[0]]
    prefixes = [tokenizer.encode(f"<|im_start|>system\nShown: {t}<|im_end|>\n", add_special_tokens=False)
                for t in texts]  # fmt: skip
    assert sorted(tuple(r["prompt"]) for _, r in requests) == sorted(tuple(p) + (5, 6, 7, 8) for p in prefixes * 2)
    assert {(url, r["model"]) for url, r in requests} == {("http://127.0.0.1:8000/v1/completions", config.model.name)}
    info, micro_batches = read_batch(tmp_path, 1)
    assert sorted((s["env"], s.get("algorithm")) for s in info.samples) == [("grpo", None)] * 2 + [("opsd", "opsd")] * 2
    advantages = sorted(s.advantages.tolist() for m in micro_batches for s in m.samples())
    assert advantages == [[-0.5] * 4, [0.0, 0.0, 0.75, 1.75], [0.0, 0.0, 0.75, 1.75], [0.5] * 4]

    orchestrator.config = config.model_copy(update={"self_distill": SelfDistillConfig(demonstration_key="nope")})
    with pytest.raises(TridentError) as refused:
        asyncio.run(orchestrator.step(2))
    assert "\n" not in str(refused.value) and str(refused.value).endswith(
        "has no 'nope' to show as its demonstration (self_distill.demonstration_key)"
    )


def test_the_policys_tokenizer_is_loaded_once_for_sample_rollouts_echo_and_opsd(tmp_path, monkeypatch):
    loaded = []  # the orchestrator's loads (the renderer loads its own, in verifiers)
    counted = SimpleNamespace(from_pretrained=lambda path: loaded.append(path) or AutoTokenizer.from_pretrained(path))
    monkeypatch.setattr(run_module, "AutoTokenizer", counted)
    config = OrchestratorConfig(output_dir=tmp_path, rollouts_per_example=2, sample_rollouts_every=1,
                                env=[{"id": "reverse-text", "algorithm": "opsd"},
                                     {"id": "char-target", "algorithm": "echo"}])  # fmt: skip
    orchestrator = Orchestrator(config)
    orchestrator.metrics.close()
    assert len(loaded) == 1 and orchestrator.chat.tokenizer is orchestrator.tokenizer


def test_opsd_needs_no_teacher_and_a_template_must_show_the_demonstration(tmp_path):
    (tmp_path / "orch.toml").write_text('algorithm = "opsd"\nrollouts_per_example = 1\n')
    assert parse_config(OrchestratorConfig, ["@", str(tmp_path / "orch.toml")]).teacher is None
    line = config_error(tmp_path, 'algorithm = "opsd"\n[self_distill]\ntemplate = "no placeholder"\n')
    assert "the template has no {demonstration}: the policy would be shown nothing" in line, line
