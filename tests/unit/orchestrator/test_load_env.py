"""An environment's dataset that cannot be read, or lacks a column its rows need, stops the orchestrator (and eval)
with one line naming the environment and the file, column or key: gsm8k-calc reads its dataset when it is built."""

import json
import re

import pytest

from contracts.errors import TridentError
from orchestrator.config import EnvConfig
from orchestrator.verifiers_adapter.envs import load_env


def gsm8k_rows(tmp_path, **row) -> str:
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(row) + "\n")
    return str(path)


@pytest.mark.parametrize(
    "dataset, message",
    [
        (lambda tmp: f"{tmp}/nope.parquet", "dataset '{tmp}/nope.parquet' not found: no such file or folder"),
        (lambda tmp: gsm8k_rows(tmp, problem="q", answer="#### 1"), "{tmp}/rows.jsonl:1: field 'question' is missing"),
        (
            lambda tmp: {"path": gsm8k_rows(tmp, question="q", answer="#### 1"), "columns": {"question": "problem"}},
            "{tmp}/rows.jsonl:1: no column 'problem' to read 'question' from (columns: question, answer)",
        ),
    ],
    ids=["missing file", "missing column", "wrong columns map"],
)
def test_a_dataset_the_environment_cannot_use_is_one_line_naming_it(tmp_path, dataset, message):
    expected = "environment 'gsm8k-calc': " + message.format(tmp=tmp_path)
    with pytest.raises(TridentError, match=f"^{re.escape(expected)}"):
        load_env(EnvConfig(id="gsm8k-calc", args={"dataset": dataset(tmp_path)}))


def test_a_misspelt_dataset_key_is_one_line_naming_it(tmp_path):
    dataset = {"path": gsm8k_rows(tmp_path, question="q", answer="#### 1"), "colums": {"question": "problem"}}
    with pytest.raises(TridentError, match=r"^environment 'gsm8k-calc' rejects its args: dataset.colums: Extra"):
        load_env(EnvConfig(id="gsm8k-calc", args={"dataset": dataset}))
