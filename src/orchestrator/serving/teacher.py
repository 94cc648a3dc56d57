"""The teacher of on-policy distillation, which scores the student's sampled tokens in their full context (vLLM's
``prompt_logprobs`` on ``/v1/completions``): a model on a vLLM server (one the user hosts, or one ``rl`` started), or
a LoRA adapter loaded on the student's server as a named run of its own (``/load_adapter``, as a run sharing the
server loads its adapters), so that the policy's adapter swaps never retire it."""

import asyncio
import os
import shutil
from pathlib import Path

import httpx

from contracts.errors import TridentError
from contracts.inference_api import COMPLETIONS, adapter_name, auth_headers
from contracts.run_dir import STABLE
from orchestrator.batching.rollout import Rollout
from orchestrator.config import TeacherConfig, server_root
from orchestrator.serving.client import InferenceClient, run_headers

TOKENIZE = "/tokenize"  # vLLM's route: {"model", "prompt", "add_special_tokens"} -> {"tokens": [...]}
# tokenized by the teacher and the student at start: a teacher whose ids differ has another tokenizer
TOKENIZER_PROBE = "Hello, world! 12345 <|im_start|>user\nÜnïcödé 🙂 def f(x):\n\treturn x ** 2<|im_end|>\n"
IN_FLIGHT = 16  # scoring requests in flight to the teacher at once
ADAPTER_STEP = 0  # the step a teacher adapter is loaded as: it never changes


def prompt_token_logprobs(answer: dict, token_ids: list[int]) -> list[float]:
    """Each token's logprob from a ``/v1/completions`` answer with ``prompt_logprobs = 0``: vLLM returns one entry
    per prompt token, None for the first (it has no context), else ``{"<token id>": {"logprob": ...}, ...}``
    holding the prompt's own token (and any top ones asked for). 0.0 for the first token."""
    entries = answer["choices"][0]["prompt_logprobs"]
    if len(entries) != len(token_ids):
        raise TridentError(f"the teacher returned {len(entries)} prompt logprobs for {len(token_ids)} tokens")
    return [0.0] + [entry[str(token)]["logprob"] for entry, token in zip(entries[1:], token_ids[1:], strict=True)]


def adapter_run(run: str | None) -> str:
    """The named run a teacher adapter is served as on the student's server: ``teacher``, or ``<run>.teacher``
    beside a named student run ``run``."""
    return "teacher" if run is None else f"{run[:56]}.teacher"


def stage_adapter(config: TeacherConfig, output_dir: Path) -> Path:
    """Copy the peft adapter folder ``config.adapter`` to ``output_dir/weights/teacher/step_0`` (marked complete):
    the server loads adapters only from ``step_N`` folders under the run's weights (its ``weights_root``)."""
    config.adapter_rank()  # a folder without an adapter: one line
    adapter = config.adapter
    folder = Path(output_dir) / "weights" / "teacher" / f"step_{ADAPTER_STEP}"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(Path(adapter).expanduser(), folder)
    (folder / STABLE).touch()
    return folder


class Teacher:
    """Scores rollouts' tokens with the teacher of :class:`~orchestrator.config.TeacherConfig`; ``student_url`` and
    ``run`` are the student's first server and its ``run_id``, where a teacher adapter is served."""

    def __init__(self, config: TeacherConfig, student_url: str, run: str | None = None):
        self.config = config
        if config.adapter is not None:
            run = adapter_run(run)
            base_url, model = server_root(student_url), adapter_name(ADAPTER_STEP, run)
            headers = auth_headers() | run_headers(run)  # the run's header keeps it from being evicted as idle
        elif config.base_url is None:
            raise TridentError(
                f"teacher.model = {config.model!r} with no teacher.base_url: rl starts the teacher's server (with "
                "--inference @ infer.toml); an orchestrator started alone needs the URL of a server you started"
            )
        else:
            base_url, model, run, headers = config.base_url, config.model, None, {}
        key = os.environ.get(config.api_key_var) if config.api_key_var else None
        headers |= {"Authorization": f"Bearer {key}"} if key else {}
        self.server = InferenceClient(base_url, config.timeout_s, model, run=run, headers=headers)
        self.base_url, self.http = base_url, self.server.http
        self.slots = asyncio.Semaphore(IN_FLIGHT)

    @property
    def model(self) -> str:
        """The name scoring requests send: the teacher's model, or the name its adapter is served under."""
        return self.server.model

    async def start(self, student: httpx.AsyncClient, student_model: str, output_dir: Path, timeout_s: float) -> None:
        """Ready the teacher: wait up to ``timeout_s`` for its server's ``/health`` (rl starts it with the run), then
        load its adapter anew (``/load_adapter``, as a named run's, from ``output_dir``'s weights), or check its
        tokenizer against the student's (:meth:`check_tokenizer`; an adapter shares the student's)."""
        await self.server.wait_ready(timeout_s)
        if self.config.adapter is not None:
            await self.server.release_run()  # an earlier orchestrator's teacher adapter, left loaded: load it anew
            await self.server.reload_weights(stage_adapter(self.config, output_dir), ADAPTER_STEP)
        else:
            await self.check_tokenizer(student, student_model)

    async def logprobs(self, token_ids: list[int]) -> list[float]:
        """The teacher's logprob of each of ``token_ids`` given the ones before it (0.0 for the first), at
        temperature 1."""
        request = {"model": self.model, "prompt": token_ids, "max_tokens": 1, "prompt_logprobs": 0,
                   "temperature": 1.0}  # fmt: skip
        async with self.slots:
            answer = await self.post(COMPLETIONS, request)
        if answer.status_code != 200:
            raise TridentError(
                f"teacher at {self.base_url} answered {answer.status_code} to scoring {len(token_ids)} "
                f"tokens: {answer.text[:300]}"
            )
        return prompt_token_logprobs(answer.json(), token_ids)

    async def score(self, groups: list[list[Rollout]], prefixes: list[list[int]] | None = None) -> None:
        """Set ``teacher_logprobs`` on every branch of the finished rollouts of ``groups``: each token's logprob in
        its full context, after the tokens ``prefixes`` gives its group (self-distillation's demonstration; none
        when None)."""
        prefixes = prefixes or [[] for _ in groups]
        branches = [(b, prefix) for group, prefix in zip(groups, prefixes, strict=True) for r in group if r.ok
                    for b in r.branches]  # fmt: skip
        scores = await asyncio.gather(*(self.logprobs(prefix + b.token_ids) for b, prefix in branches))
        for (branch, prefix), teacher_logprobs in zip(branches, scores, strict=True):
            branch.teacher_logprobs = teacher_logprobs[len(prefix) :]

    async def check_tokenizer(self, student: httpx.AsyncClient, student_model: str) -> None:
        """Refuse, in one line, a teacher whose server tokenizes :data:`TOKENIZER_PROBE` into other ids than the
        student's server (``student``, a client of it) does: its logprobs would score other tokens."""
        probe = {"prompt": TOKENIZER_PROBE, "add_special_tokens": False}
        ours = await student.post(TOKENIZE, json={"model": student_model, **probe})
        theirs = await self.post(TOKENIZE, {"model": self.model, **probe})
        for who, answer in (("student", ours), ("teacher", theirs)):
            if answer.status_code != 200:
                raise TridentError(f"the {who}'s server answered {answer.status_code} to {TOKENIZE}: {answer.text}")
        if ours.json()["tokens"] != theirs.json()["tokens"]:
            raise TridentError(
                f"teacher.model = {self.config.model!r} tokenizes text into other ids than the student "
                f"{student_model!r} (a fixed text's {TOKENIZE} on both servers): distillation needs the same tokenizer"
            )

    async def post(self, route: str, request: dict) -> httpx.Response:
        """POST ``request`` to the teacher's ``route``; a :class:`TridentError` naming its URL when it cannot answer."""
        try:
            return await self.http.post(route, json=request)
        except httpx.HTTPError as e:
            raise TridentError(
                f"teacher.base_url = {self.base_url!r} did not answer {route} ({type(e).__name__}: {e}): "
                "start the teacher's server first"
            ) from None

    async def close(self) -> None:
        """Remove a teacher adapter from the student's server (its named run ends), then close the client."""
        await self.server.release_run()
        await self.server.close()
