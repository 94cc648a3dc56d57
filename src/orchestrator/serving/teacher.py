"""The teacher of on-policy distillation: a vLLM server the user hosts, which scores the student's sampled tokens in
their full context (vLLM's ``prompt_logprobs`` on ``/v1/completions``)."""

import asyncio
import os

import httpx

from contracts.errors import TridentError
from contracts.inference_api import COMPLETIONS
from orchestrator.batching.rollout import Rollout
from orchestrator.config import TeacherConfig

TOKENIZE = "/tokenize"  # vLLM's route: {"model", "prompt", "add_special_tokens"} -> {"tokens": [...]}
# tokenized by the teacher and the student at start: a teacher whose ids differ has another tokenizer
TOKENIZER_PROBE = "Hello, world! 12345 <|im_start|>user\nÜnïcödé 🙂 def f(x):\n\treturn x ** 2<|im_end|>\n"
IN_FLIGHT = 16  # scoring requests in flight to the teacher at once


def prompt_token_logprobs(answer: dict, token_ids: list[int]) -> list[float]:
    """Each token's logprob from a ``/v1/completions`` answer with ``prompt_logprobs = 0``: vLLM returns one entry
    per prompt token, None for the first (it has no context), else ``{"<token id>": {"logprob": ...}, ...}``
    holding the prompt's own token (and any top ones asked for). 0.0 for the first token."""
    entries = answer["choices"][0]["prompt_logprobs"]
    if len(entries) != len(token_ids):
        raise TridentError(f"the teacher returned {len(entries)} prompt logprobs for {len(token_ids)} tokens")
    return [0.0] + [entry[str(token)]["logprob"] for entry, token in zip(entries[1:], token_ids[1:], strict=True)]


class Teacher:
    """Scores rollouts' tokens on the teacher's server (:class:`~orchestrator.config.TeacherConfig`)."""

    def __init__(self, config: TeacherConfig):
        self.config = config
        key = os.environ.get(config.api_key_var) if config.api_key_var else None
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.http = httpx.AsyncClient(base_url=config.base_url, timeout=config.timeout_s, headers=headers)
        self.slots = asyncio.Semaphore(IN_FLIGHT)

    async def logprobs(self, token_ids: list[int]) -> list[float]:
        """The teacher's logprob of each of ``token_ids`` given the ones before it (0.0 for the first), at
        temperature 1."""
        request = {"model": self.config.model, "prompt": token_ids, "max_tokens": 1, "prompt_logprobs": 0,
                   "temperature": 1.0}  # fmt: skip
        async with self.slots:
            answer = await self.post(COMPLETIONS, request)
        if answer.status_code != 200:
            raise TridentError(
                f"teacher at {self.config.base_url} answered {answer.status_code} to scoring {len(token_ids)} "
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
        theirs = await self.post(TOKENIZE, {"model": self.config.model, **probe})
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
                f"teacher.base_url = {self.config.base_url!r} did not answer {route} ({type(e).__name__}: {e}): "
                "start the teacher's server first"
            ) from None

    async def close(self) -> None:
        await self.http.aclose()
