"""An LLM judge as an environment's reward (``[env.judge]``), plugged into verifiers' own judge mechanism.

verifiers 0.4.0 runs a task config's ``judges`` after the task's ``@reward`` functions and adds each judge's score
to the rewards under its name. :func:`with_judge` plugs :class:`TridentJudge` there, configured by the
``[env.judge]`` table; the judge asks a model at an OpenAI-compatible URL (by default the inference server the
rollout's own calls went to, and the model it sampled from) and reads a yes/no verdict or a number from its reply.

A judge call that fails (connection refused, an HTTP error, past ``timeout_s``) or a reply without the verdict is
a :class:`JudgeError`: an infrastructure error (``orchestrator.batching.infra``), so the rollout runs again and, if the
judge keeps failing, its group is lost; it never scores the rollout 0.
"""

import contextlib
import re
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import openai
import verifiers.v1 as vf
from verifiers.v1.errors import RolloutError
from verifiers.v1.judge import judge_response
from verifiers.v1.utils.score import parse_judge_choice

from contracts.errors import TridentError
from contracts.inference_api import API_KEY_ENV
from orchestrator.config import EnvConfig, JudgeConfig
from orchestrator.verifiers_adapter.limits import model_call_slot

# verifiers imports a judge plugin as the top-level module its id names (registered by install_patches)
JUDGE_ID = "trident-judge"

DEFAULT_PROMPTS = {
    "yes_no": "Here is a task and a reply to it.\n\nTask:\n{prompt}\n\nReply:\n{completion}\n\n"
    "Does the reply complete the task correctly? Answer with one word: yes or no.",
    "number": "Here is a task and a reply to it.\n\nTask:\n{prompt}\n\nReply:\n{completion}\n\n"
    "How well does the reply complete the task, from 0 (not at all) to {max_score} (perfectly)? "
    "Answer with the number only.",
}
# A number, with an optional "/ scale" after it ("7/10" reads 7); not the digits of a word, a version or a negative.
NUMBER = re.compile(r"(?<![\w.\-])(\d+(?:\.\d+)?)(?:\s*/\s*\d+(?:\.\d+)?)?")

_rollout_model: ContextVar[vf.ModelContext | None] = ContextVar("trident_rollout_model", default=None)


class JudgeError(RolloutError):
    """The judge did not score a completion: its call failed, or its reply held no verdict."""


@contextlib.contextmanager
def judging_rollouts_of(ctx: vf.ModelContext) -> Iterator[None]:
    """Judges of rollouts started inside default to ``ctx``'s server and model (the rollouts' own)."""
    token = _rollout_model.set(ctx)
    try:
        yield
    finally:
        _rollout_model.reset(token)


def constraint(config: JudgeConfig) -> dict[str, Any]:
    """vLLM's structured outputs that admit only the replies :func:`parse_score` reads: "yes" or "no", or a number
    from 0 to ``config.max_score`` (with up to 3 decimals)."""
    if config.parse == "yes_no":
        return {"choice": ["yes", "no"]}
    below = "|".join(str(n) for n in range(config.max_score))
    return {"regex": rf"({below})(\.\d{{1,3}})?|{config.max_score}(\.0{{1,3}})?"}


def parse_score(reply: str, config: JudgeConfig) -> float:
    """The score in [0, 1] that ``reply`` gives under ``config.parse``: a yes/no verdict (verifiers' reading: a
    "verdict:" or "answer:" line, else the last yes or no) as 1 or 0, or the last number, from 0 to
    ``config.max_score``, divided by it. Text before a ``</think>`` is left out. Raises :class:`JudgeError` when
    there is none."""
    text = reply.rsplit("</think>", 1)[-1]
    if config.parse == "yes_no":
        verdict = parse_judge_choice(text, ("yes", "no"))
        if verdict is None:
            raise JudgeError(f"the judge's reply holds no yes/no verdict: {reply[:300]!r}")
        return float(verdict == "yes")
    numbers = [float(match.group(1)) for match in NUMBER.finditer(text)]
    if not numbers or not 0 <= numbers[-1] <= config.max_score:
        raise JudgeError(f"the judge's reply holds no number from 0 to {config.max_score}: {reply[:300]!r}")
    return numbers[-1] / config.max_score


class TridentJudgeConfig(vf.JudgeConfig):
    """verifiers' judge config (endpoint, reward name and weight) around the ``[env.judge]`` table."""

    id: str = JUDGE_ID
    base_url: str = ""  # and model, api_key_var: set for each call (TridentJudge._endpoint)
    api_key_var: str = API_KEY_ENV
    judge: JudgeConfig


class TridentJudge(vf.Judge[float, TridentJudgeConfig]):
    """Scores a completion by asking a model, as ``[env.judge]`` says."""

    def __init__(self, config: TridentJudgeConfig) -> None:
        super().__init__(config)
        self.prompt = config.judge.prompt or DEFAULT_PROMPTS[config.judge.parse]

    async def score(self, task: vf.TaskData, trace: vf.Trace) -> float:
        judge = self.config.judge
        fields = {
            "prompt": task.prompt_text,
            "completion": judge_response(trace, judge.view),
            "max_score": str(judge.max_score),
        }
        if "{answer}" in self.prompt:
            fields["answer"] = str(getattr(task, judge.answer_field))
        self.config = self.config.model_copy(update=self._endpoint())  # a judge is built for each score
        sampling: dict[str, Any] = {"max_tokens": judge.max_tokens, "temperature": judge.temperature}
        if judge.constrain:
            sampling["structured_outputs"] = constraint(judge)
        async with model_call_slot(self.config.base_url):
            try:
                response = await self.complete(
                    self.build_messages(**fields), trace=trace, timeout=judge.timeout_s, **sampling
                )
            except openai.OpenAIError as e:
                where = f"model {self.config.model!r} at {self.config.base_url}"
                raise JudgeError(f"the judge ({where}) failed: {type(e).__name__}: {e}") from e
        return parse_score(response.text, judge)

    def _endpoint(self) -> dict[str, str]:
        """Where this call goes: the configured URL, model and key, else the rollout's server and model."""
        judge, rollout = self.config.judge, _rollout_model.get()
        if rollout is None and (judge.url is None or judge.model is None):
            raise ValueError("the judge has no url or model: outside a Trident run, set both in [env.judge]")
        return {
            "base_url": judge.url or rollout.client.base_url,
            "model": judge.model or rollout.model,
            # the run's key goes to the run's server only; "" names no variable: no key
            "api_key_var": judge.api_key_var or (rollout.client.api_key_var if judge.url is None else ""),
        }


def with_judge(taskset_args: dict[str, Any], judge: JudgeConfig | None) -> dict[str, Any]:
    """A taskset's config arguments with ``judge`` appended to its task config's ``judges``."""
    if judge is None:
        return taskset_args
    task = dict(taskset_args.get("task") or {})
    entry = {"id": JUDGE_ID, "name": judge.name, "weight": judge.weight, "judge": judge.model_dump()}
    return {**taskset_args, "task": {**task, "judges": [*task.get("judges", []), entry]}}


def check_judged(env: EnvConfig, where: str, task: vf.Task) -> None:
    """Refuse an ``[env.judge]`` that ``task`` (one of the environment's) cannot run: a taskset whose tasks do not
    take its task config, a name that a reward of the task has, an {answer} from a field the task lacks."""
    judge = env.judge
    if judge is None:
        return
    if not any(isinstance(plugged, TridentJudgeConfig) for plugged in task.config.judges):
        raise TridentError(
            f"{where}.judge: the tasks of {env.id!r} do not take their taskset's task config (config.task), "
            "so no judge can be plugged into them"
        )
    if judge.name in {fn.__name__ for fn in task.hooks("reward")}:
        raise TridentError(f"{where}.judge.name = {judge.name!r} is a reward of {env.id!r} already: name the judge")
    if "{answer}" in (judge.prompt or "") and getattr(task.data, judge.answer_field, None) is None:
        raise TridentError(
            f"{where}.judge.answer_field = {judge.answer_field!r}: the tasks of {env.id!r} have no such field to "
            "fill the prompt's {answer}"
        )


__all__ = ["TridentJudge"]
