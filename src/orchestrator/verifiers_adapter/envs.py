"""Environments and their rollouts, through verifiers (pinned to 0.4.0): load environments, run rollouts, and turn
verifiers' traces into :class:`~orchestrator.batching.rollout.Rollout` values without re-tokenizing anything."""

import asyncio
import dataclasses
import functools
import itertools
import logging
import os
import traceback
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import verifiers.v1 as vf
from dataset_rows import DatasetError
from pydantic import ValidationError
from verifiers.v1.configs.agent import agent_config_fields
from verifiers.v1.utils.generic import concrete_type
from verifiers.v1.utils.loaders import default_harness_id, environment_class, harness_class

from contracts.errors import TridentError, error_line
from contracts.inference_api import API_KEY_ENV
from contracts.model_card import ModelCard
from orchestrator.batching.images import EpisodeImages, sample_images
from orchestrator.batching.rollout import Branch, Rollout
from orchestrator.config import EnvConfig, EvalRunConfig, OrchestratorConfig
from orchestrator.serving.client import run_headers
from orchestrator.tasks.stream import Tasks, read_tasks
from orchestrator.verifiers_adapter.advice import held_warnings, release
from orchestrator.verifiers_adapter.harness import HARNESS_ID, InProcessHarness
from orchestrator.verifiers_adapter.judge import judging_rollouts_of, with_judge
from orchestrator.verifiers_adapter.limits import RolloutLimits
from orchestrator.verifiers_adapter.renderer import renderer_config
from orchestrator.verifiers_adapter.runtimes import container_need, container_runtime
from orchestrator.verifiers_adapter.weight_steps import node_weight_steps

logger = logging.getLogger("orchestrator")
# what the rest of the orchestrator holds of verifiers, by these names: a loaded environment, and how rollouts sample
Env = vf.Env
ModelContext = vf.ModelContext
IMAGE_PLACEHOLDER = 1  # the marker of an image placeholder token in renderers' mm_token_type_id_map
_configs: weakref.WeakKeyDictionary[vf.Env, EnvConfig] = weakref.WeakKeyDictionary()  # what load_env loaded


def harness_for(env: EnvConfig) -> str:
    """The harness id each agent of ``env`` runs: ``env.harness`` ("trident": Trident's in-process one), or for "auto"
    what verifiers itself would run: the harness the taskset's package declares (a ``vf.Harness`` subclass in its
    ``__all__``; Trident's own environments declare the in-process one), else verifiers' default, "bash"."""
    if env.harness != "auto":
        return HARNESS_ID if env.harness == "trident" else env.harness
    declared = default_harness_id(env.id)
    return HARNESS_ID if harness_class(declared) is InProcessHarness else declared


def load_env(env: EnvConfig) -> vf.Env:
    """Load the verifiers environment for the taskset package ``env.id`` (``env.args`` its config): the taskset's
    own ``Env`` or the one ``env.verifiers_env`` names (e.g. "user-sim"), each of its agents on :func:`harness_for`'s
    harness and on the machine, in the runtime :mod:`~orchestrator.verifiers_adapter.runtimes` chooses, never on
    remote sandboxes, with ``env.judge`` plugged into its tasks' judges
    (:func:`~orchestrator.verifiers_adapter.judge.with_judge`). Every model call still reaches the server through
    verifiers' training client, so tokens are the server's whatever harness runs."""
    harness = harness_for(env)
    try:
        if env.runtime in ("auto", "subprocess"):
            # a taskset may read its dataset when built; verifiers' warnings about the subprocess runtime stand only
            # if the environment runs in it
            with dataset_errors_named(env.id), held_warnings() as warnings:
                loaded = _construct(env, harness, vf.SubprocessConfig())
            need = container_need(loaded, harness, first_task(loaded)) if env.runtime == "auto" else None
            if need is None:
                release(warnings)
                _configs[loaded] = env
                return loaded
        else:
            need = f"[[env]] runtime = {env.runtime!r}"
        runtime = container_runtime(env.id, env.runtime, need)
        logger.info(f"environment {env.id!r} runs its agents in {runtime.type} containers: {need}")
        with dataset_errors_named(env.id):
            _configs[loaded := _construct(env, harness, runtime)] = env
        return loaded
    except ModuleNotFoundError as e:
        raise TridentError(f"environment {env.id!r} is not installed: {e}") from None
    except ValidationError as e:
        problems = "; ".join(f"{_arg_path(err['loc'])}: {err['msg']}" for err in e.errors())
        raise TridentError(f"environment {env.id!r} rejects its args: {problems}") from None


def _arg_path(loc: tuple) -> str:
    """A key of the environment's config as ``[[env]]`` names it: in ``args`` (its taskset's) by its name, in
    ``env_args`` as ``env_args.<key>``."""
    return ".".join(map(str, loc[1:] if loc[:1] == ("taskset",) else ["env_args", *loc]))


def env_config(env: vf.Env) -> EnvConfig:
    """The config :func:`load_env` loaded ``env`` from."""
    return _configs[env]


def _construct(env: EnvConfig, harness: str, runtime) -> vf.Env:
    """The environment of ``env`` (its own config from ``env.env_args``), each agent on ``harness`` in ``runtime``."""
    env_cls = environment_class(env.id, env.verifiers_env)
    config_cls = concrete_type(env_cls, vf.EnvConfig, origin=vf.Env) or vf.EnvConfig
    agents = {
        name: {
            **env.env_args.get(name, {}),
            "harness": {"id": harness},
            "runtime": runtime,
            **({"max_turns": env.max_turns} if env.max_turns else {}),
            **({"timeout": {"setup": env.timeout_s, "rollout": env.timeout_s}} if env.timeout_s else {}),
        }
        for name, field in config_cls.model_fields.items()
        if isinstance(field.default, vf.AgentConfig)
    }
    taskset = with_judge({"id": env.id, **env.args}, env.judge)
    config = config_cls.model_validate({**env.env_args, "id": env.verifiers_env, "taskset": taskset, **agents})
    return env_cls(config)


def load_tasks(env: vf.Env, limit: int) -> list:
    """The first ``limit`` tasks of ``env``'s taskset, read now (:func:`open_tasks`)."""
    return list(itertools.islice(open_tasks(env), limit))


def first_task(env: vf.Env):
    """``env``'s first task (:func:`open_tasks`), or None where its taskset yields none."""
    return next(open_tasks(env), None)


def open_tasks(env: vf.Env) -> Iterator:
    """``env``'s tasks, read lazily from a fresh ``load()`` through verifiers' read path (each task's ``idx`` its
    position, the taskset config's ``system_prompt`` applied). A dataset that cannot be read
    (:class:`dataset_rows.DatasetError`, naming the file, row or hub id), or any other exception ``load()`` raises,
    is one line naming the environment; the exception's traceback goes to the log."""
    env_id = env.config.taskset.id
    with dataset_errors_named(env_id):
        try:
            yield from env.taskset
        except (DatasetError, TridentError):
            raise
        except Exception as e:
            logger.warning(f"environment {env_id!r}: its taskset's load() raised", exc_info=True)
            raise TridentError(f"environment {env_id!r}: loading its tasks failed: {error_line(e)}") from None


def tasks_of(env: vf.Env) -> Tasks:
    """``env``'s tasks for training (:func:`~orchestrator.tasks.stream.read_tasks`): held whole, or a stream when its
    taskset says it never ends (verifiers' ``Taskset.INFINITE``) or yields more than ``[[env]] max_tasks``."""
    config = env_config(env)
    endless = not env.taskset.bounded
    return read_tasks(config.id, functools.partial(open_tasks, env), endless, config.max_tasks, config.max_load_gib)


@contextmanager
def dataset_errors_named(env_id: str):
    """A dataset that cannot be read inside (:class:`dataset_rows.DatasetError`) is one line naming ``env_id``."""
    try:
        yield
    except DatasetError as e:
        raise TridentError(f"environment {env_id!r}: {e}") from None


NO_API_KEY_VAR = "TRIDENT_NO_API_KEY"  # names no key: the client sends a placeholder ("none", else verifiers' "EMPTY")


def model_context(config: OrchestratorConfig | EvalRunConfig, tokenizer_path: str) -> vf.ModelContext:
    """How verifiers reaches our server: the training client, token in / token out through the model's renderer
    (:func:`~orchestrator.verifiers_adapter.renderer.renderer_config`), with our sampling.

    Requests name the base model at the first server: :func:`at_server` samples from another, or from a served
    adapter. A named run's requests carry its id (:func:`~orchestrator.serving.client.run_headers`), by which the server
    counts its fair share.
    """
    key_var = API_KEY_ENV
    if not os.environ.get(API_KEY_ENV):
        # verifiers' client needs some key, which a server without one ignores. Not under TRIDENT_API_KEY: a server
        # started later from this process (tests, benchmarks) would take it as its key.
        key_var = NO_API_KEY_VAR
        os.environ[key_var] = "none"
    return vf.ModelContext(
        model=config.model.name,
        client=vf.TrainClientConfig(
            base_url=config.client.base_urls[0].rstrip("/") + "/v1",  # a lease points it at one of several servers
            api_key_var=key_var,
            renderer=renderer_config(
                config.model.renderer, config.model.chat_family, tokenizer_path, config.sampling.enable_thinking
            ),
            renderer_model_name=tokenizer_path,
            headers=run_headers(config.run_id),
        ),
        sampling=vf.SamplingConfig(
            **config.sampling.request_params(tuple(ModelCard.of(config.model.name).vision_markers().values()))
        ),
    )


def at_server(ctx: vf.ModelContext, base_url: str, model: str, api_key_var: str | None = None) -> vf.ModelContext:
    """``ctx`` sampling from the server at ``base_url`` (its ``/v1`` URL) under the name ``model`` it serves the
    policy as (with the key in ``api_key_var``, when given)."""
    update = {"base_url": base_url} | ({"api_key_var": api_key_var} if api_key_var else {})
    return dataclasses.replace(ctx, model=model, client=ctx.client.model_copy(update=update))


def trace_branches(trace: vf.Trace, images: EpisodeImages | None = None) -> list[Branch]:
    """Each trainable branch of ``trace`` as a :class:`~orchestrator.batching.rollout.Branch`, straight from the
    server's tokens, with its routes (:func:`_branch_routes`), its tokens' weights steps
    (:func:`_branch_weight_steps`) and, when ``images`` is given, its images stored there (:func:`_branch_images`;
    None: none read).

    Forked branches share message nodes; a sampled node is trained once, in the first branch holding it.
    """
    pad = _image_pad(trace) if images is not None else None
    seen: set[int] = set()
    out = []
    for branch in trace.branches:
        if not branch.trainable:
            continue
        mask: list[bool] = []
        for node in branch.nodes:
            trained_before = node.sampled and id(node) in seen
            mask += [False] * len(node.mask) if trained_before else list(node.mask)
            seen.add(id(node))
        out.append(
            Branch(
                token_ids=branch.token_ids,
                loss_mask=mask,
                logprobs=branch.logprobs,
                routes=_branch_routes(branch),
                weight_steps=_branch_weight_steps(branch),
                images=_branch_images(branch, pad, images) if images is not None else [],
            )
        )
    return out


def _branch_routes(branch: vf.Branch) -> torch.Tensor | None:
    """The experts the server routed each of ``branch``'s tokens to, ``[tokens, layers, top_k]`` uint8, or None where
    it returned none for some of them (a server without ``enable_return_routed_experts``, a dense model)."""
    routes = branch.routed_experts
    if routes is not None and routes.size and int(routes.max()) > np.iinfo(np.uint8).max:
        raise TridentError(f"the server routed a token to expert {int(routes.max())}: routes hold ids below 256")
    return None if routes is None else torch.from_numpy(routes.astype(np.uint8))


def _branch_weight_steps(branch: vf.Branch) -> list[int | None]:
    """The weights step of each of ``branch``'s tokens: the step that sampled it, as the server labelled it
    (:mod:`~orchestrator.verifiers_adapter.weight_steps`); None for a token not sampled, or sampled by a server that
    labelled none."""
    steps: list[int | None] = []
    for node in branch.nodes:
        sampled = iter(node_weight_steps(node.logprobs) or [None] * sum(node.mask))
        steps += [next(sampled) if trained else None for trained in node.mask]
    return steps


def _image_pad(trace: vf.Trace) -> int | None:
    """The token of an image placeholder in ``trace``'s token ids (renderers' ``mm_token_type_id_map``), if any."""
    return next((token for token, kind in trace.mm_token_type_id_map.items() if kind == IMAGE_PLACEHOLDER), None)


def _branch_images(branch: vf.Branch, pad: int | None, images: EpisodeImages) -> list[str]:
    """The refs of ``branch``'s images, stored in ``images``: the images of its messages in order, one per placeholder
    run of ``pad`` in its token ids (the server expanded each image to its placeholder tokens:
    :func:`~orchestrator.batching.images.sample_images`); empty when it shows none."""
    sources = [
        part.image_url.url
        for node in branch.nodes
        if isinstance(node.message.content, list)
        for part in node.message.content
        if part.type == "image_url"
    ]
    if pad is None and not sources:
        return []
    return sample_images(branch.token_ids, branch.sampled_mask, sources, pad, images)


def _setup_seconds(trace: vf.Trace) -> float | None:
    timing = trace.timing
    return timing.setup.end - timing.boot.start if timing.setup.end and timing.boot.start else None


# What verifiers 0.4.0 records (``verifiers.v1.errors``) when the infrastructure, not the rollout, broke: a tool server
# that did not start or answer, a runtime or sandbox, the interception server, a set-up past infra.setup_timeout_s,
# a judge that did not score a completion (its call failed or its reply held no verdict).
INFRA_TYPES = {"ToolsetError", "SandboxError", "InterceptionError", "TunnelError", "SetupTimeoutError", "JudgeError"}


def is_infra(error: vf.Error | None) -> bool:
    """Whether ``error`` (as verifiers recorded it) is the infrastructure's, not the rollout's: one of
    :data:`INFRA_TYPES`, or a model call the server did not answer (``ProviderError`` with a 5xx or 429 status:
    connection refused, timeout, overload). Such a rollout is marked ``lost`` once its retries are spent
    (:mod:`orchestrator.batching.infra`)."""
    if error is None:
        return False
    if error.type == "ProviderError":
        return error.status_code is None or error.status_code >= 500 or error.status_code == 429
    return error.type in INFRA_TYPES


def _error_text(error: vf.Error | None) -> str | None:
    return f"{error.type}: {error.message}" if error is not None else None


def _traceback_text(error: vf.Error | None) -> str | None:
    """The traceback verifiers recorded with ``error`` (none for a provider's error, whose message says it all)."""
    return error.traceback if error is not None else None


def task_id(data: vf.TaskData) -> str:
    """The task's id, or its index in the taskset when it has none."""
    return str(data.id if data.id is not None else data.idx)


def seats(env: vf.Env) -> list[str]:
    """The seats ``env`` declares: its config's agent fields (``player0``, ``player1``; ``agent`` alone for a
    single-agent environment), in declaration order."""
    return list(agent_config_fields(env.config))


def to_rollouts(
    episode: vf.Episode, env_id: str, seat_names: list[str], model: str, output_dir: Path | None = None
) -> list[Rollout]:
    """The rollouts of an episode: one per trace, tagged with the seat that played it, in ``seat_names``' order (a
    seat that played several times gives several), and a failed rollout carrying the episode's error for each seat
    that left no trace. A trace the environment does not train (``trace.agent.trainable``: e.g. a simulated user) or
    sampled from another model than ``model`` (the run's, as the server serves it) is an untrained rollout: no
    branches, so no sample. The images its trained rollouts showed are stored in the run at ``output_dir``, each
    once (:class:`~orchestrator.batching.images.EpisodeImages`)."""
    task = task_id(episode.task.data)
    images = EpisodeImages(output_dir)
    by_seat = {name: [t for t in episode.traces if t.agent.name == name] for name in seat_names}
    rollouts = []
    for name, traces in by_seat.items():
        if not traces:
            error = _error_text(episode.last_error) or f"the environment returned no trace of seat {name!r}"
            rollouts.append(Rollout(reward=0.0, branches=[], ok=False, error=error, env=env_id, task=task, seat=name,
                                    traceback=_traceback_text(episode.last_error),
                                    lost=is_infra(episode.last_error)))  # fmt: skip
        rollouts += [_trace_rollout(trace, episode, env_id, task, model, images) for trace in traces]
    return rollouts


def _trace_rollout(
    trace: vf.Trace, episode: vf.Episode, env_id: str, task: str, model: str, images: EpisodeImages
) -> Rollout:
    """The rollout of one seat's trace of ``episode``, the images of a trained one's branches stored in ``images``."""
    trained = trace.agent.trainable and trace.agent.config.model == model
    ok = bool(episode.ok) and not trace.is_timeout  # a timed-out rollout was cut short: not trained on
    return Rollout(
        reward=float(trace.reward or 0.0),
        branches=trace_branches(trace, images if ok else None) if trained else [],  # a failed one's images: unread
        ok=ok,
        truncated=any(call.finish_reason == "length" for call in trace.calls),
        error=_error_text(trace.last_error or episode.last_error)
        or ("TimeoutError: the rollout timed out ([[env]] timeout_s)" if trace.is_timeout else None),
        traceback=_traceback_text(trace.last_error or episode.last_error),
        rewards={name: r.score for name, r in trace.rewards.items() if r is not None},
        metrics={name: value for name, value in trace.metrics.items() if value is not None},
        turns=len(trace.calls),
        env=env_id,
        task=task,
        lost=not ok and is_infra(trace.last_error or episode.last_error),
        setup_s=_setup_seconds(trace),
        seat=trace.agent.name,
        trained=trained,
    )


def _first_lost(rollouts: list[Rollout]) -> Rollout | None:
    return next((r for r in rollouts if r.lost), None)


async def run_group(
    env: vf.Env, task, n: int, ctx: vf.ModelContext, limits: RolloutLimits, output_dir: Path | None = None
) -> list[Rollout]:
    """The rollouts of ``n`` episodes of one task (one advantage group; each episode gives one rollout per seat,
    :func:`to_rollouts`, its images stored in the run at ``output_dir``), each episode run again with backoff, up to
    ``limits.max_retries`` times, while one of its rollouts fails with an infrastructure error (:func:`is_infra`). A
    judge of theirs defaults to ``ctx``'s server and model."""

    env_id, seat_names = env.config.taskset.id, seats(env)

    async def attempt(slot) -> list[Rollout]:
        async with limits.rollouts:
            try:
                with limits.setting_up():
                    return to_rollouts(await env.run_slot(slot, ctx), env_id, seat_names, ctx.model, output_dir)
            except Exception as e:  # verifiers records the environment's own faults; anything else lands here
                logger.debug(f"rollout of {env_id!r} raised", exc_info=True)
                error, trace = f"{type(e).__name__}: {e}", "".join(traceback.format_exception(e))
                return [Rollout(reward=0.0, branches=[], ok=False, error=error, traceback=trace, env=env_id,
                                task=task_id(task.data), seat=name) for name in seat_names]  # fmt: skip

    announced: set[int] = set()  # the retry rounds of this group said in the log: one line each

    async def one(slot) -> list[Rollout]:
        retries = 0
        while (lost := _first_lost(rollouts := await attempt(slot))) and retries < limits.max_retries:
            if retries not in announced:
                announced.add(retries)
                logger.warning(
                    f"environment {env_id!r}, task {lost.task}: an infrastructure error, its rollouts run again in "
                    f"{limits.backoff(retries):g}s (retry {retries + 1} of {limits.max_retries}): {lost.error}"
                )
            await asyncio.sleep(limits.backoff(retries))
            retries += 1
        for rollout in rollouts:
            rollout.retries = retries
        return rollouts

    with judging_rollouts_of(ctx):
        episodes = await asyncio.gather(*(one(slot) for slot in env.slots(task, n)))
    for number, rollouts in enumerate(episodes):
        for rollout in rollouts:
            rollout.episode = number
    return [rollout for rollouts in episodes for rollout in rollouts]
