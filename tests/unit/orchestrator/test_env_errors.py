"""An environment that cannot run stops the orchestrator at start, before any rollout, with one line naming it, the
cause and what to do: a taskset whose ``load()`` raises (its traceback in the log), and a prompt with images for a
text model (a training or a held-out environment's). This module is the environment of :data:`ENV_ID`, a taskset
written as verifiers' documentation shows."""

import logging
import re
import sys

import pytest
import verifiers.v1 as vf

from contracts.errors import TridentError
from contracts.model_path import TINY_MODEL_ID
from launch.supervise import failure_message
from orchestrator.config import EnvConfig, EvalConfig, OrchestratorConfig
from orchestrator.loop.evaluation import load_eval_sets
from orchestrator.loop.run import Orchestrator
from orchestrator.verifiers_adapter.envs import first_task, load_env
from orchestrator.verifiers_adapter.harness import InProcessHarness
from orchestrator.verifiers_adapter.prompt_images import check_model_sees_images
from tools.tiny_model import built_model_path

ENV_ID = "trident-test-env-errors"
sys.modules.setdefault(ENV_ID.replace("-", "_"), sys.modules[__name__])
# what nltk raises for a corpus not downloaded: the cause inside a banner of asterisks
NLTK_BANNER = """
**********************************************************************
  Resource punkt not found.
  Please use the NLTK Downloader to obtain the resource:

  >>> import nltk
  >>> nltk.download('punkt')
**********************************************************************
"""
IMAGE = vf.ImageUrlContentPart(image_url=vf.ImageUrlSource(url="data:image/png;base64,AAAA"))


class ErrorsTasksetConfig(vf.TasksetConfig):
    shows: str = "nothing"  # "nothing": load() raises; "chained": raises another while handling it; "images": a
    # prompt of two images


class ErrorsTask(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def one(self, trace: vf.Trace) -> float:
        return 1.0


class ErrorsTaskset(vf.Taskset[ErrorsTask, ErrorsTasksetConfig]):
    def load(self):
        if self.config.shows == "nothing":
            raise LookupError(NLTK_BANNER)
        if self.config.shows == "chained":  # as a library that wraps what it could not do
            try:
                raise LookupError(NLTK_BANNER)
            except LookupError as e:
                raise RuntimeError("could not load the tokenizer 'punkt'") from e
        prompt = [vf.UserMessage(content=[vf.TextContentPart(text="How many shapes?"), IMAGE, IMAGE])]
        yield ErrorsTask(vf.TaskData(id="t0", prompt=prompt), self.config.task)


__all__ = ["InProcessHarness", "ErrorsTaskset"]


def test_a_taskset_whose_load_raises_stops_the_start_with_one_line_and_its_traceback_in_the_log(tmp_path, caplog):
    cause = (
        "LookupError: Resource punkt not found. Please use the NLTK Downloader to obtain the resource: >>> import "
        "nltk >>> nltk.download('punkt')"
    )
    with caplog.at_level(logging.WARNING), pytest.raises(TridentError) as error:
        Orchestrator(OrchestratorConfig(output_dir=tmp_path, env=[{"id": ENV_ID}]))
    assert str(error.value) == f"environment {ENV_ID!r}: loading its tasks failed: {cause}"
    (record,) = [r for r in caplog.records if r.exc_info]
    assert record.exc_info[0] is LookupError and "load()" in record.getMessage()
    chained = {"id": ENV_ID, "args": {"shows": "chained"}}
    with pytest.raises(TridentError) as error:  # the chain's first exception is the real cause: named too
        Orchestrator(OrchestratorConfig(output_dir=tmp_path, env=[chained]))
    assert str(error.value) == (
        f"environment {ENV_ID!r}: loading its tasks failed: RuntimeError: could not load the tokenizer 'punkt' (from "
        "LookupError: Resource punkt not found. Please use the NLTK Downloader to obtain the resource: >>> import "
        "nltk >>> nltk.download('punkt'))"
    )


def test_rl_shows_the_line_a_process_failed_with_not_the_end_of_its_log(tmp_path):
    line = f"environment {ENV_ID!r}: loading its tasks failed: LookupError: Resource punkt not found."
    log = tmp_path / "orchestrator.log"
    log.write_text(f"12:00:01 orchestrator ERROR orchestrator failed: {line}\n" + NLTK_BANNER * 3)
    assert failure_message("orchestrator", 1, log) == f"orchestrator exited with code 1: orchestrator failed: {line} " \
                                                      f"(its log: {log})"  # fmt: skip
    log.write_text("Traceback (most recent call last):\n" + NLTK_BANNER)  # a crash: no line of ours, so the tail
    assert failure_message("orchestrator", 1, log).endswith("\n".join(f"  | {x}" for x in NLTK_BANNER.splitlines()))


def test_a_prompt_with_images_for_a_text_model_is_refused_at_start_naming_the_environment_and_the_model(tmp_path):
    env = {"id": ENV_ID, "args": {"shows": "images"}}
    error = (
        f"env.0: environment {ENV_ID!r} shows images (its first task's prompt holds 2), but model {TINY_MODEL_ID!r} "
        "is a text model (no vision tower)"
    )
    with pytest.raises(TridentError, match=f"^{re.escape(error)}"):
        Orchestrator(OrchestratorConfig(output_dir=tmp_path, model={"name": TINY_MODEL_ID}, env=[env]))
    task = first_task(load_env(EnvConfig(**env)))
    check_model_sees_images(ENV_ID, "env.0", task, built_model_path("trident/tiny-qwen3-vl"))  # a VLM takes it


def test_an_eval_env_with_images_for_a_text_model_is_refused_at_start_in_a_run_and_in_eval(tmp_path):
    env = {"id": ENV_ID, "args": {"shows": "images"}}
    error = f"eval.env.1: environment {ENV_ID!r} shows images (its first task's prompt holds 2), but model "
    held_out = {"env": [{"id": "reverse-text"}, env], "num_examples": 1}
    with pytest.raises(TridentError, match=f"^{re.escape(error)}"):  # the orchestrator's evaluations
        Orchestrator(OrchestratorConfig(output_dir=tmp_path, env=[{"id": "reverse-text"}], eval=held_out))
    with pytest.raises(TridentError, match=f"^{re.escape(error)}"):  # the eval command's (eval_main.evaluate)
        load_eval_sets(EvalConfig(**held_out), TINY_MODEL_ID)
    assert len(load_eval_sets(EvalConfig(**held_out), built_model_path("trident/tiny-qwen3-vl"))) == 2
