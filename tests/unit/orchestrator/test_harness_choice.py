"""``[[env]] harness = "auto"`` runs what verifiers itself would run: the harness a taskset's package declares, else
verifiers' default, ``bash``. This module is the environment of :data:`ENV_ID`, a taskset written as verifiers'
documentation shows for its bash harness ("use bash once to ..."), declaring no harness. Its first request to the
model is rendered by each harness against a fake model server: verifiers' chat program runs here, in this process,
from the source its harness hands the runtime (the subprocess runtime would fetch its packages with ``uv``)."""

import asyncio
import importlib
import json
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import verifiers.v1 as vf
from aiohttp import web
from aiohttp.test_utils import TestServer
from verifiers.v1.utils.loaders import harness_class, harness_config_type

from orchestrator.config import EnvConfig
from orchestrator.verifiers_adapter.envs import first_task, harness_for, load_env
from orchestrator.verifiers_adapter.harness import HARNESS_ID

ENV_ID = "trident-test-bash-style"
sys.modules.setdefault(ENV_ID.replace("-", "_"), sys.modules[__name__])
PROMPT = "Use bash once to print the word ready, then reply with what it printed."
SYSTEM = "Answer in one word."
REPO = Path(__file__).parents[3]


class BashStyleTask(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def replied(self, trace: vf.Trace) -> float:
        return float(bool(trace.assistant_messages))


class BashStyleTaskset(vf.Taskset[BashStyleTask, vf.TasksetConfig]):
    def load(self):
        yield BashStyleTask(vf.TaskData(id="t0", prompt=PROMPT, system_prompt=SYSTEM), self.config.task)


__all__ = ["BashStyleTaskset"]


class ChatProgramRuntime:
    """Stands in for the runtime of a harness that runs verifiers' chat program: ``prepare_uv_script`` keeps the
    program's source, ``run_program`` runs it in this process with the harness's argv."""

    async def prepare_uv_script(self, source: str, env: dict, activate: bool = True) -> list[str]:
        self.source = source
        return ["chat-program"]

    async def write(self, path: str, content: bytes) -> None:
        Path(path).write_bytes(content)

    async def run_program(self, argv: list[str], env: dict) -> vf.ProgramResult:
        program = {"__name__": "verifiers_chat_program"}
        exec(compile(self.source, "verifiers_chat_program", "exec"), program)
        with mock.patch.object(sys, "argv", argv):
            await program["main"]()
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


def model_server(requests: list[dict]) -> web.Application:
    """A model that records each chat request and answers "ready" (streamed when asked), with no model cards."""

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        requests.append(body)
        choice = {"index": 0, "finish_reason": "stop"}
        head = {"id": "c0", "created": 0, "model": body["model"]}
        if not body.get("stream"):
            message = {"role": "assistant", "content": "ready"}
            return web.json_response({**head, "object": "chat.completion", "choices": [{**choice, "message": message}]})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        delta = {"role": "assistant", "content": "ready"}
        chunk = {**head, "object": "chat.completion.chunk", "choices": [{**choice, "delta": delta}]}
        await response.write(f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())
        return response

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": []})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    return app


async def first_request(harness_id: str, data: vf.TaskData) -> dict:
    """The model, messages and tools of the first request the harness ``harness_id`` (its default config) sends for
    a task of ``data``."""
    harness = harness_class(harness_id)(harness_config_type(harness_id).model_validate({"id": harness_id}))
    requests: list[dict] = []
    async with TestServer(model_server(requests)) as server:
        endpoint = str(server.make_url("/v1"))
        ctx, trace = SimpleNamespace(model="policy"), SimpleNamespace(id="trace-0")
        result = await harness.launch(ctx, trace, ChatProgramRuntime(), endpoint, "secret", {}, data)
    assert result.exit_code == 0, result.stderr
    return {key: requests[0].get(key) for key in ("model", "messages", "tools")}


def test_auto_renders_the_first_prompt_and_tools_as_verifiers_bash_harness_does():
    env = load_env(EnvConfig(id=ENV_ID))
    data = first_task(env).data
    ours = asyncio.run(first_request(env.config.agent.harness.id, data))
    verifiers = asyncio.run(first_request("bash", data))  # what verifiers runs for a taskset declaring no harness
    assert [tool["function"]["name"] for tool in verifiers["tools"]] == ["bash", "edit"]
    assert verifiers["messages"][-1] == {"role": "user", "content": PROMPT}
    assert verifiers["messages"][0]["role"] == "system" and verifiers["messages"][0]["content"].endswith(SYSTEM)
    assert ours == verifiers


def test_auto_is_the_declared_harness_else_verifiers_default_and_trident_forces_the_in_process_one():
    assert harness_for(EnvConfig(id=ENV_ID)) == "bash"
    assert harness_for(EnvConfig(id=ENV_ID, harness="trident")) == HARNESS_ID
    assert harness_for(EnvConfig(id=ENV_ID, harness="null")) == "null"
    assert load_env(EnvConfig(id=ENV_ID, harness="trident")).config.agent.harness.id == HARNESS_ID


def trident_environments() -> list[str]:
    """The ids of the environments in environments/ (the workspace members whose package exports a taskset)."""
    ids = []
    for pyproject in sorted(REPO.glob("environments/*/pyproject.toml")):
        name = tomllib.loads(pyproject.read_text())["project"]["name"]
        module = importlib.import_module(name.replace("-", "_"))
        if any(isinstance(getattr(module, n), type) and issubclass(getattr(module, n), vf.Taskset)
               for n in module.__all__):  # fmt: skip
            ids.append(name)
    return ids


def config_environments() -> set[tuple[str, str]]:
    """Each ``[[env]]`` / ``[[eval.env]]`` table of configs/ that leaves ``harness`` at "auto", as (file, id)."""
    found = set()

    def walk(node, path: Path):
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "env" and isinstance(value, list):
                    found.update((str(path.relative_to(REPO)), EnvConfig(**table).id) for table in value
                                 if table.get("harness", "auto") == "auto")  # fmt: skip
                else:
                    walk(value, path)

    for path in REPO.glob("configs/**/*.toml"):
        walk(tomllib.loads(path.read_text()), path)
    return found


def test_tridents_environments_and_configs_run_the_in_process_harness_they_are_written_for():
    ids = trident_environments()
    assert {"reverse-text", "gsm8k-calc", "char-target", "digit-duel"} <= set(ids)
    assert {env_id: harness_for(EnvConfig(id=env_id)) for env_id in ids} == {env_id: HARNESS_ID for env_id in ids}
    configs = config_environments()
    assert ("configs/debug/rl/orch.toml", "char-target") in configs
    # none starts verifiers' subprocess harnesses, which fetch their chat program's packages with uv
    assert {(f, env_id): harness_for(EnvConfig(id=env_id)) for f, env_id in configs} == {c: HARNESS_ID for c in configs}
