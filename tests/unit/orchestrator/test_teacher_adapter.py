"""A teacher that is a LoRA adapter on the student's server: what loads it (``/load_adapter`` as a named run of its
own), the name its scoring requests then send, its release at the end; and a teacher model without a URL outside
``rl``. The fake server answers as Trident's server on vLLM does (a model name it does not serve is vLLM's 404)."""

import asyncio
import json

import httpx
import pytest

from contracts.config import ConfigError, parse_config
from contracts.errors import TridentError
from contracts.inference_api import RUN_HEADER
from orchestrator.config import OrchestratorConfig, TeacherConfig
from orchestrator.serving.teacher import Teacher


class FakeServer:
    """The student's server: the base model ``small``, LoRA on, adapters loaded per run (None: the unnamed run)."""

    def __init__(self):
        self.requests: list[tuple[str, str, dict, str | None]] = []  # method, path, body, run header
        self.adapters: dict[str | None, str] = {}  # run -> the adapter name it is served

    def answer(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        path = request.url.path
        self.requests.append((request.method, path, body, request.headers.get(RUN_HEADER)))
        if path == "/health":
            return httpx.Response(200)
        if path == "/load_adapter":  # inference.routes.WeightsRoutes.load_adapter: <run>/lora-step-N
            name = f"lora-step-{body['step']}" if body["run"] is None else f"{body['run']}/lora-step-{body['step']}"
            if self.adapters.get(body["run"]) == name:
                return httpx.Response(409, json={"detail": f"adapter {name} is already served"})
            self.adapters[body["run"]] = name
            return httpx.Response(200, json={"step": body["step"], "path": body["path"], "adapter": name,
                                             "seconds": 0.1})  # fmt: skip
        if path == "/weights":
            run = request.url.params.get("run")
            return httpx.Response(200, json={"step": 0, "path": "/base", "adapter": self.adapters.get(run)})
        if path == "/release_run":
            return httpx.Response(200, json={"run": body["run"], "released": self.adapters.pop(body["run"], 0) != 0})
        if path == "/v1/completions":
            if body["model"] not in ("small", *self.adapters.values()):  # vLLM's answer to a name it does not serve
                message = f"The model `{body['model']}` does not exist."
                return httpx.Response(404, json={"error": {"message": message, "type": "NotFoundError", "code": 404}})
            entries = [None] + [{str(t): {"logprob": -1.0, "rank": 1}} for t in body["prompt"][1:]]
            return httpx.Response(200, json={"choices": [{"index": 0, "text": "", "prompt_logprobs": entries}]})
        return httpx.Response(404, json={"detail": "Not Found"})


def adapter_teacher(tmp_path, server: FakeServer, run: str | None = None) -> Teacher:
    adapter = tmp_path / "my-adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8}')
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    teacher = Teacher(TeacherConfig(adapter=str(adapter)), "http://127.0.0.1:8000/v1", run)
    teacher.server.http = teacher.http = httpx.AsyncClient(
        base_url=teacher.base_url, headers=teacher.http.headers, transport=httpx.MockTransport(server.answer)
    )
    return teacher


def test_a_teacher_adapter_loads_as_a_named_run_of_its_own_and_scores_under_its_name(tmp_path):
    """The adapter is copied to weights/teacher/step_0 (the server loads only step_N folders under the run's
    weights), loaded by POST /load_adapter as run 'teacher', scored as 'teacher/lora-step-0' with the run's header,
    and released when the orchestrator closes it."""
    server = FakeServer()
    teacher = adapter_teacher(tmp_path, server)
    staged = tmp_path / "out" / "weights" / "teacher" / "step_0"

    async def run() -> list[float]:
        await teacher.start(httpx.AsyncClient(), "small", tmp_path / "out", timeout_s=5)
        scores = await teacher.logprobs([5, 6, 7])
        await teacher.close()
        return scores

    assert asyncio.run(run()) == [0.0, -1.0, -1.0]
    assert sorted(p.name for p in staged.iterdir()) == ["STABLE", "adapter_config.json", "adapter_model.safetensors"]
    assert [(method, path) for method, path, _, _ in server.requests] == [
        ("GET", "/health"), ("POST", "/release_run"), ("POST", "/load_adapter"), ("GET", "/weights"),
        ("POST", "/v1/completions"), ("POST", "/release_run"),
    ]  # fmt: skip
    load, score = server.requests[2], server.requests[4]
    assert load[2] == {"path": str(staged.resolve()), "step": 0, "in_flight": False, "run": "teacher"}
    assert score[2]["model"] == "teacher/lora-step-0" and score[3] == "teacher"
    assert server.adapters == {}  # released: nothing left on the student's server


def test_beside_a_named_student_run_the_teacher_adapter_is_its_own_run(tmp_path):
    server = FakeServer()
    teacher = adapter_teacher(tmp_path, server, run="exp1")
    asyncio.run(teacher.start(httpx.AsyncClient(), "small", tmp_path / "out", timeout_s=5))
    assert teacher.model == "exp1.teacher/lora-step-0" and server.adapters == {"exp1.teacher": teacher.model}


def test_a_folder_without_an_adapter_is_refused_in_one_line(tmp_path):
    teacher = Teacher(TeacherConfig(adapter=str(tmp_path)), "http://127.0.0.1:8000")
    teacher.server.http = httpx.AsyncClient(transport=httpx.MockTransport(FakeServer().answer), base_url="http://s")
    with pytest.raises(TridentError) as refused:
        asyncio.run(teacher.start(httpx.AsyncClient(), "small", tmp_path / "out", timeout_s=5))
    assert str(refused.value) == (
        f"teacher.adapter = {str(tmp_path)!r}: no peft adapter there (a folder with adapter_config.json giving its "
        "rank r)"
    )


def test_a_teacher_model_without_a_url_is_refused_outside_rl_in_one_line():
    with pytest.raises(TridentError) as refused:
        Teacher(TeacherConfig(model="big"), "http://127.0.0.1:8000")
    assert str(refused.value) == (
        "teacher.model = 'big' with no teacher.base_url: rl starts the teacher's server (with --inference @ "
        "infer.toml); an orchestrator started alone needs the URL of a server you started"
    )


@pytest.mark.parametrize(
    ("flags", "line"),
    [(["--teacher.adapter", "a", "--teacher.model", "big"],
      "--teacher.model: teacher: teacher.adapter = 'a' is served on the student's server: leave teacher.model out"),
     (["--teacher.adapter", "a", "--teacher.base-url", "http://h:1"],
      "--teacher.base-url: teacher: teacher.adapter = 'a' is served on the student's server: leave teacher.base_url "
      "out"),
     (["--teacher.coef", "0.5"], "--teacher.coef: teacher: [teacher] names no teacher: give teacher.model (with "
                                 "base_url for a server you start) or teacher.adapter")],
)  # fmt: skip
def test_a_teacher_table_that_is_not_exactly_one_teacher_is_refused_in_one_line(flags, line):
    with pytest.raises(ConfigError) as refused:
        parse_config(OrchestratorConfig, flags)
    assert str(refused.value) == line
