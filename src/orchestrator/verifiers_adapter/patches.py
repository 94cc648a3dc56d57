"""Every change Trident makes to the libraries it runs rollouts with, in one place, applied by one call.

Each entry point that runs rollouts (``orchestrator``, ``eval``, a rollout worker, the benchmarks and scripts that run
them, the test session) calls :func:`install_patches` once at its start; importing a module never patches anything.
One that does not finds no Trident harness ("harness 'trident-in-process' not found"). The replacements live beside
what they serve; each calls the library's own function, read when its module was imported, so installing twice
changes nothing.
"""

import sys
from collections.abc import Sequence

import datasets
import renderers.base
import renderers.client
from pydantic._internal import _fields
from verifiers.v1.clients import train
from verifiers.v1.clients.train import TrainClient
from verifiers.v1.rollout import Rollout as VerifiersRollout
from verifiers.v1.runtimes.subprocess import SubprocessRuntime

from orchestrator.config import LocalDataset
from orchestrator.verifiers_adapter import (
    advice,
    harness,
    judge,
    limits,
    local_datasets,
    pydantic_defaults,
    tokenizer_memo,
    weight_steps,
)
from orchestrator.verifiers_adapter.generate_transport import GenerateTransport


def install_patches(local_data: Sequence[LocalDataset] = ()) -> None:
    """Apply Trident's patches to verifiers, renderers, datasets and pydantic in this process (see each module
    named), environments' hub datasets read from ``local_data`` (the config's ``[[datasets]]``)."""
    # verifiers imports a harness or judge plugin as the top-level module its id names
    sys.modules.setdefault(harness.HARNESS_ID.replace("-", "_"), harness)
    sys.modules.setdefault(judge.JUDGE_ID.replace("-", "_"), judge)
    # limits: a set-up holds a set-up slot and is watched for tool servers that exit; a model call holds its server's
    VerifiersRollout.open = limits.limited_open
    SubprocessRuntime.run_background = limits.watched_run_background
    TrainClient.get_response = limits.limited_get_response
    # generate_transport: verifiers' training client reaches the server over aiohttp
    train.build_async_openai = GenerateTransport
    # tokenizer_memo: renderers' tokenizers remember short encodes and decodes
    renderers.base.load_tokenizer = tokenizer_memo.load_memoized
    # weight_steps: each sampled token's weights step rides its node's logprobs list into verifiers' rollout graph
    renderers.client._parse_completion_logprobs = weight_steps.parse_completion_logprobs
    # pydantic_defaults: verifiers' rollout graph is built with model_construct on every turn
    _fields.takes_validated_data_argument = pydantic_defaults.takes_validated_data_argument
    # advice: verifiers' warnings name Trident's [[env]] keys, not its own CLI's flags
    advice.install_advice_filter()
    # local_datasets: environments' own load_dataset calls read the local data [[datasets]] maps their hub ids to
    datasets.load_dataset = local_datasets.load_dataset
    local_datasets.set_local_datasets(local_data)
