"""swe-grep-oss-env: find the files that must change to resolve an issue, searching the repository with bash.

Each task is an issue and a repository. The model searches a fresh copy of the repository with the ``bash``
tool (confined to that copy: :mod:`swe_grep_oss_env.sandbox`), then calls ``result`` with the files that must
change, which ends the rollout. Tasks come from one of two sources:

- generated (the default): ``num_examples`` small Python projects, each with one planted bug or missing
  feature and an issue that describes it in user terms (:mod:`swe_grep_oss_env.synthetic`). Deterministic in
  ``seed``; nothing is downloaded.
- SWE-bench Lite style records (``dataset``, a :class:`dataset_rows.DatasetSpec`: a JSONL or parquet file, a
  folder of them, a ``save_to_disk`` folder or a hub id; also accepted as ``dataset_path``) with
  ``instance_id``, ``problem_statement`` and ``patch`` (the gold diff; the answer is the files it touches) per row,
  and a local snapshot of each repository: the row's ``repo_path``, else ``<repos_dir>/<instance_id>``
  (``repos_dir`` defaults to ``repos/`` beside the data). See :mod:`swe_grep_oss_env.swebench`.

Rewards (weights in the config): ``correct_files_reward`` (share of answer files named),
``incorrect_files_penalty`` (share of named files that are wrong), ``missed_files_penalty`` (share of answer
files not named), ``max_tokens_penalty`` (more sampled tokens than ``max_tokens``), ``max_tool_calls_penalty``
(more tool calls than ``max_tool_calls``), ``completion_bonus`` (``result`` was called).
"""

import asyncio
import random
from pathlib import Path
from typing import Annotated

import verifiers.v1 as vf
from dataset_rows import TasksetDataset
from pydantic import Field
from reward_weights import with_reward_weights

from orchestrator.verifiers_adapter.harness import InProcessHarness
from swe_grep_oss_env import rewards, swebench, synthetic
from swe_grep_oss_env.tools import REPO_DIR

SYSTEM_PROMPT = (
    "You find where code must change. The repository an issue is about is checked out in your working directory. "
    "Search it with the bash tool (grep -rn, find, ls, sed -n 'START,ENDp' FILE, head), then call the result tool "
    "once with the paths, relative to the repository root, of the files that must change to resolve the issue: "
    "source files, not tests. You have at most {max_tool_calls} tool calls and about {max_tokens} tokens, so "
    "search rather than read whole files."
)

PROMPT = """\
Find the files that must change to resolve this issue.

<issue>
{issue}
</issue>"""


class SweGrepConfig(vf.TasksetConfig):
    num_examples: Annotated[int, Field(ge=1)] = 64
    """Generated tasks (not used with dataset)."""
    seed: int = 0
    """Seed of the task generator."""
    dataset: TasksetDataset = None
    """SWE-bench Lite style records to load instead of generating tasks: a path, or {path, split, columns, streaming,
    ...} (dataset_rows.DatasetSpec); also accepted as dataset_path."""
    repos_dir: str | None = None
    """Directory holding a snapshot per instance id, for rows without repo_path (default: repos/ beside the data)."""
    max_tokens: Annotated[int, Field(ge=1)] = 1024
    """Sampled tokens per rollout above which max_tokens_penalty applies."""
    max_tool_calls: Annotated[int, Field(ge=1)] = 20
    """Tool calls per rollout above which max_tool_calls_penalty applies; the model gets one more turn than this."""
    bash_timeout_s: Annotated[float, Field(gt=0, le=600)] = 10.0
    """Seconds one bash command may run before its whole process tree is killed."""
    bash_output_bytes: Annotated[int, Field(ge=256)] = 2048
    """Bytes of a bash command's output the model sees; the rest is cut with a note."""
    bash_memory_mb: Annotated[int, Field(ge=64)] = 2048
    """Address space per process of a bash command, in MiB."""
    correct_files_weight: float = 1.0
    """Weight of correct_files_reward."""
    incorrect_files_weight: float = -0.5
    """Weight of incorrect_files_penalty (negative: a penalty)."""
    missed_files_weight: float = -0.25
    """Weight of missed_files_penalty (negative: a penalty)."""
    max_tokens_weight: float = -0.5
    """Weight of max_tokens_penalty (negative: a penalty)."""
    max_tool_calls_weight: float = -0.5
    """Weight of max_tool_calls_penalty (negative: a penalty)."""
    completion_weight: float = 0.1
    """Weight of completion_bonus."""


class SweGrepData(vf.TaskData):
    answer_files: list[str]
    """Files that must change, relative to the repository root."""
    synthetic_seed: int | None = None
    """Seed of the generated repository (generated tasks)."""
    repo_path: str | None = None
    """Repository snapshot to copy (SWE-bench tasks)."""
    tools: list[str] = ["swe_grep_oss_env.tools:bash", "swe_grep_oss_env.tools:result"]
    """The model's tools, as module:function paths."""
    final_tools: list[str] = ["result"]
    """Tools whose call ends the rollout."""
    max_turns: int = 21
    """Model turns per rollout."""
    max_tokens: int = 1024
    max_tool_calls: int = 20
    bash_timeout_s: float = 10.0
    bash_output_bytes: int = 2048
    bash_memory_mb: int = 2048


class SweGrepTask(vf.Task[SweGrepData, vf.State, vf.TaskConfig]):
    async def setup(self, trace: vf.Trace, runtime: vf.Runtime) -> None:
        """Write (generated) or copy (snapshot) the repository into the rollout's ``workdir/repo``."""
        await asyncio.to_thread(materialize_repo, self.data, Path(runtime.workdir) / REPO_DIR)

    @vf.reward(weight=1.0)
    async def correct_files_reward(self, task: SweGrepData, trace: vf.Trace) -> float:
        return rewards.file_scores(rewards.named_files(trace.assistant_messages), task.answer_files).correct

    @vf.reward(weight=-0.5)
    async def incorrect_files_penalty(self, task: SweGrepData, trace: vf.Trace) -> float:
        return rewards.file_scores(rewards.named_files(trace.assistant_messages), task.answer_files).incorrect

    @vf.reward(weight=-0.25)
    async def missed_files_penalty(self, task: SweGrepData, trace: vf.Trace) -> float:
        return rewards.file_scores(rewards.named_files(trace.assistant_messages), task.answer_files).missed

    @vf.reward(weight=-0.5)
    async def max_tokens_penalty(self, task: SweGrepData, trace: vf.Trace) -> float:
        usage = trace.usage
        sampled = rewards.sampled_token_count(trace.nodes, usage.completion_tokens if usage else None)
        return rewards.over_limit(sampled, task.max_tokens)

    @vf.reward(weight=-0.5)
    async def max_tool_calls_penalty(self, task: SweGrepData, trace: vf.Trace) -> float:
        return rewards.over_limit(len(rewards.tool_calls(trace.assistant_messages)), task.max_tool_calls)

    @vf.reward(weight=0.1)
    async def completion_bonus(self, task: SweGrepData, trace: vf.Trace) -> float:
        return float(rewards.named_files(trace.assistant_messages) is not None)


def materialize_repo(data: SweGrepData, destination: Path) -> None:
    """The task's repository at ``destination`` (which must not exist yet)."""
    if data.repo_path is not None:
        swebench.copy_snapshot(Path(data.repo_path), destination)
        return
    plan = synthetic.plan(data.synthetic_seed)
    if plan.answer_files != data.answer_files:
        raise RuntimeError(f"task {data.id}: the generator no longer plants the recorded bug; reload the taskset")
    for relative, text in synthetic.repo_files(plan).items():
        path = destination / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


class SweGrepTaskset(vf.Taskset[SweGrepTask, SweGrepConfig]):
    def load(self):
        config = self.config
        task_config = self.task_config()
        common = dict(
            system_prompt=SYSTEM_PROMPT.format(max_tool_calls=config.max_tool_calls, max_tokens=config.max_tokens),
            max_turns=config.max_tool_calls + 1,
            max_tokens=config.max_tokens,
            max_tool_calls=config.max_tool_calls,
            bash_timeout_s=config.bash_timeout_s,
            bash_output_bytes=config.bash_output_bytes,
            bash_memory_mb=config.bash_memory_mb,
        )
        if config.dataset is not None:
            repos_dir = Path(config.repos_dir) if config.repos_dir is not None else None
            for record in swebench.read_records(config.dataset, repos_dir):
                prompt = PROMPT.format(issue=record.problem_statement.strip())
                data = SweGrepData(
                    id=record.instance_id,
                    prompt=prompt,
                    answer_files=record.answer_files,
                    repo_path=record.repo_path,
                    **common,
                )
                yield SweGrepTask(data, task_config)
            return
        rng = random.Random(config.seed)
        for i in range(config.num_examples):
            plan = synthetic.plan(rng.getrandbits(32))
            data = SweGrepData(
                id=f"swe-grep-{config.seed}-{i}",
                name=f"{plan.package}: {plan.bug}",
                prompt=PROMPT.format(issue=plan.issue),
                answer_files=plan.answer_files,
                synthetic_seed=plan.seed,
                **common,
            )
            yield SweGrepTask(data, task_config)

    def task_config(self) -> vf.TaskConfig:
        """The config's task settings, with the reward weights of this config (a weight set under
        ``task.rewards`` wins)."""
        config = self.config
        weights = {
            "correct_files_reward": config.correct_files_weight,
            "incorrect_files_penalty": config.incorrect_files_weight,
            "missed_files_penalty": config.missed_files_weight,
            "max_tokens_penalty": config.max_tokens_weight,
            "max_tool_calls_penalty": config.max_tool_calls_weight,
            "completion_bonus": config.completion_weight,
        }
        return with_reward_weights(config.task, weights)


__all__ = ["InProcessHarness", "SweGrepConfig", "SweGrepData", "SweGrepTask", "SweGrepTaskset"]
