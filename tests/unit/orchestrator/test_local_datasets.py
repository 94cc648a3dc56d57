"""Local data for hub datasets that environments load in their own code (``[[datasets]]``), and an unreachable hub
failing at once in one line. The environments are shaped as verifiers' reverse-text and gsm8k examples
(tests/e2e/user_envs/hub_reverse_text, hub_gsm8k): their ``load_dataset("<hub id>", ...)`` calls are theirs,
unchanged; the rows are made here."""

import itertools
import json
import socket
import time
from pathlib import Path

import datasets
import pytest
from datasets.arrow_writer import ArrowWriter
from pydantic import ValidationError

from contracts.errors import TridentError
from orchestrator.config import EnvConfig, LocalDataset, OrchestratorConfig
from orchestrator.verifiers_adapter import local_datasets
from orchestrator.verifiers_adapter.envs import load_env, load_tasks
from orchestrator.verifiers_adapter.patches import install_patches

USER_ENVS = Path(__file__).parents[2] / "e2e" / "user_envs"  # packages as outside users write them

REVERSE_ID, GSM8K_ID = "PrimeIntellect/Reverse-Text-RL", "openai/gsm8k"
SAVED_ID = "someone/reverse-text-saved"  # reverse-text's dataset_name arg pointed at another id, saved by save_to_disk
REVERSE_ROWS = {"train": ["abc", "hello"], "test": ["stressed", "drawer", "lager"]}
GSM8K_ROWS = {
    "train": [("Tom has 3 apples and buys 4 more. How many?", "3 + 4 = 7\n#### 7")],
    "test": [("A box holds 12 eggs. How many in 2 boxes?", "12 * 2 = 24\n#### 24"),
             ("Half of 50?", "50 / 2 = 25\n#### 25")],
}  # fmt: skip


@pytest.fixture
def offline_machine(monkeypatch, tmp_path):
    """The user environments importable, the hub unreachable (as on this machine, and on any machine the test runs
    on), an empty datasets cache, and the map emptied again after the test."""
    monkeypatch.syspath_prepend(str(USER_ENVS))
    monkeypatch.setattr(local_datasets, "hub_reachable", lambda: False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    yield
    install_patches()


@pytest.fixture
def local_rows(tmp_path):
    """The rows, written as a user would: reverse-text's as a folder split by file name (train.jsonl, test.jsonl) and
    as a DatasetDict written by save_to_disk, gsm8k's each split alone, train as parquet and test as JSON Lines."""
    folder = tmp_path / "reverse"
    folder.mkdir()
    for split, prompts in REVERSE_ROWS.items():
        (folder / f"{split}.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    saved = tmp_path / "reverse-saved"
    by_split = {split: [{"prompt": p} for p in prompts] for split, prompts in REVERSE_ROWS.items()}
    datasets.DatasetDict({split: datasets.Dataset.from_list(rows) for split, rows in by_split.items()}).save_to_disk(
        str(saved)
    )
    train = tmp_path / "gsm8k-train.parquet"
    rows = [{"question": q, "answer": a} for q, a in GSM8K_ROWS["train"]]
    datasets.Dataset.from_list(rows).to_parquet(str(train))
    test = tmp_path / "gsm8k-test.jsonl"
    test.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in GSM8K_ROWS["test"]))
    return [
        LocalDataset(id=REVERSE_ID, path=folder),
        LocalDataset(id=SAVED_ID, path=saved),
        LocalDataset(id=GSM8K_ID, name="main", split="train", path=train),
        LocalDataset(id=GSM8K_ID, name="main", split="test", path=test),
    ]


def tasks(env_id: str, **args) -> list:
    return load_tasks(load_env(EnvConfig(id=env_id, args=args)), 100)


def test_hub_ids_mapped_to_local_rows_load_them_split_by_split(offline_machine, local_rows):
    install_patches(local_rows)
    for (split, prompts), dataset_name in itertools.product(REVERSE_ROWS.items(), [REVERSE_ID, SAVED_ID]):
        loaded = tasks("hub-reverse-text", dataset_name=dataset_name, dataset_split=split)
        assert [(t.data.prompt, t.data.answer) for t in loaded] == [(p, p[::-1]) for p in prompts]
    for split, rows in GSM8K_ROWS.items():
        loaded = tasks("hub-gsm8k", split=split)
        assert [t.data.answer for t in loaded] == [a.split("#### ")[-1] for _, a in rows]
        assert [t.data.prompt.split("\n\n")[-1] for t in loaded] == [q for q, _ in rows]


def write_hf_cache(root: Path, hub_id: str, config: str, splits: dict[str, list[dict]]) -> None:
    """``splits`` as ``datasets`` leaves a hub dataset in its cache after a download: ``<org>___<name>/<config>/
    <version>/<hash>/``, an arrow file per split and the dataset's info."""
    name = hub_id.split("/")[-1]
    folder = root / hub_id.replace("/", "___") / config / "0.0.0" / "0123abcd"
    folder.mkdir(parents=True)
    infos = []
    for split, rows in splits.items():
        table = datasets.Dataset.from_list(rows)
        with ArrowWriter(path=str(folder / f"{name}-{split}.arrow"), features=table.features) as writer:
            writer.write_table(table.data.table)
            count, size = writer.finalize()
        infos.append(datasets.SplitInfo(name=split, num_bytes=size, num_examples=count, dataset_name=name))
    splits_info = datasets.SplitDict.from_split_dict(infos, dataset_name=name)
    datasets.DatasetInfo(features=table.features, config_name=config, dataset_name=name, splits=splits_info)\
        .write_to_directory(str(folder))  # fmt: skip


def test_an_hf_datasets_cache_serves_as_local_data_and_as_the_cache_an_unreachable_hub_falls_back_on(
    offline_machine, tmp_path, monkeypatch
):
    rows = {split: [{"question": q, "answer": a} for q, a in pairs] for split, pairs in GSM8K_ROWS.items()}
    write_hf_cache(tmp_path / "copied-cache", GSM8K_ID, "main", rows)
    socratic = {split: [{"question": "Why?", "answer": "Because.\n#### 0"}] for split in rows}
    write_hf_cache(tmp_path / "copied-cache", GSM8K_ID, "socratic", socratic)  # another config of the same id
    install_patches([LocalDataset(id=GSM8K_ID, path=tmp_path / "copied-cache")])
    assert [t.data.answer for t in tasks("hub-gsm8k", split="test")] == ["24", "25"]
    install_patches()  # unmapped: the hub cannot be reached, and datasets' own cache has it
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "copied-cache"))
    assert [t.data.answer for t in tasks("hub-gsm8k", split="train")] == ["7"]


def test_without_local_data_an_unreachable_hub_fails_at_once_in_one_line_naming_env_id_and_option(offline_machine):
    install_patches()
    for env_id, args, hub_id in [("hub-reverse-text", {}, REVERSE_ID), ("hub-gsm8k", {"split": "test"}, GSM8K_ID)]:
        start = time.monotonic()
        with pytest.raises(TridentError) as failed:
            tasks(env_id, **args)
        assert time.monotonic() - start < 5  # not datasets' half a minute of retries
        line = str(failed.value)
        assert "\n" not in line and line.startswith(f"environment {env_id!r}: hub dataset {hub_id!r}")
        assert "cannot be reached" in line and f'[[datasets]] id = "{hub_id}"' in line


def test_a_mapped_id_without_the_split_asked_is_one_line_not_a_trip_to_the_hub(offline_machine, local_rows):
    install_patches(local_rows[2:3])  # gsm8k's train split alone
    with pytest.raises(TridentError, match=r"^environment 'hub-gsm8k': hub dataset 'openai/gsm8k' \(config 'main', "
                                           r"split 'test'\) has no local data: \[\[datasets\]\] maps it only for "
                                           r"\(config 'main', split 'train'\)$"):  # fmt: skip
        tasks("hub-gsm8k", split="test")


def test_the_most_specific_table_of_an_id_serves_each_call(offline_machine, local_rows):
    every_split, test_split = local_rows[2].model_copy(update={"split": None}), local_rows[3]
    install_patches([every_split, test_split])  # the table for any split first
    assert [t.data.answer for t in tasks("hub-gsm8k", split="test")] == ["24", "25"]  # the test split's own file
    assert [t.data.answer for t in tasks("hub-gsm8k", split="train")] == ["7"]  # the other table's file


def test_a_folder_of_one_splits_files_is_read_in_order_without_its_hidden_ones(offline_machine, tmp_path):
    folder = tmp_path / ".shared" / "gsm8k-test"  # under a dotted folder, as ~/.cache is
    (folder / ".cache").mkdir(parents=True)
    for i, (question, answer) in enumerate(GSM8K_ROWS["test"]):
        (folder / f"part-{i}.jsonl").write_text(json.dumps({"question": question, "answer": answer}) + "\n")
    (folder / ".cache" / "stale.jsonl").write_text(json.dumps({"question": "Old?", "answer": "#### 1"}) + "\n")
    install_patches([LocalDataset(id=GSM8K_ID, name="main", split="test", path=folder)])
    assert [t.data.answer for t in tasks("hub-gsm8k", split="test")] == ["24", "25"]


def test_unmapped_calls_pass_through_untouched(offline_machine, local_rows, monkeypatch):
    install_patches(local_rows)
    rows = local_rows[3].path
    assert datasets.load_dataset("json", data_files=str(rows), split="train")["answer"][1] == "50 / 2 = 25\n#### 25"
    calls = []
    monkeypatch.setattr(local_datasets, "hub_reachable", lambda: True)
    monkeypatch.setattr(local_datasets, "_hub_load_dataset", lambda *a, **k: calls.append((a, k)) or "from the hub")
    assert datasets.load_dataset("openai/other", "main", split="train[:5]", revision="v2") == "from the hub"
    assert calls == [(("openai/other", "main"), {"split": "train[:5]", "revision": "v2"})]


def test_bad_local_data_is_one_line_naming_the_key_and_value(offline_machine, tmp_path):
    with pytest.raises(ValidationError, match=r"datasets\.0\.path\n.*'data/none': no such file or folder"):
        OrchestratorConfig(datasets=[{"id": GSM8K_ID, "path": "data/none"}])
    (tmp_path / "rows.txt").write_text("x")
    with pytest.raises(ValidationError, match=r"datasets\.0\.path\n.*rows\.txt': cannot read a \.txt file"):
        OrchestratorConfig(datasets=[{"id": GSM8K_ID, "path": str(tmp_path / "rows.txt")}])
    with pytest.raises(ValidationError, match=r"entries 0 and 1 both map 'openai/gsm8k'"):
        OrchestratorConfig(datasets=[{"id": GSM8K_ID, "path": str(tmp_path)}] * 2)
    broken = tmp_path / "broken.parquet"
    broken.write_text("not parquet")
    install_patches([LocalDataset(id=GSM8K_ID, path=broken)])
    with pytest.raises(TridentError) as failed:
        tasks("hub-gsm8k", split="test")
    line = str(failed.value)
    assert "\n" not in line
    assert line.startswith(
        f"environment 'hub-gsm8k': [[datasets]] id = \"{GSM8K_ID}\" path = \"{broken}\" (config 'main', split "
        "'test'): cannot be read"
    )


def test_the_hub_probe_answers_by_a_connection_to_the_endpoint(monkeypatch):
    for proxy in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.delenv(proxy, raising=False)
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        monkeypatch.setattr(datasets.config, "HF_ENDPOINT", f"http://127.0.0.1:{port}")
        local_datasets.hub_reachable.cache_clear()
        assert local_datasets.hub_reachable()
    local_datasets.hub_reachable.cache_clear()
    start = time.monotonic()
    assert not local_datasets.hub_reachable()  # nothing listens there now
    assert time.monotonic() - start < local_datasets.PROBE_TIMEOUT_S + 1
    local_datasets.hub_reachable.cache_clear()
