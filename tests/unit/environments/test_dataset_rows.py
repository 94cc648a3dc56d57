"""dataset_rows: the same rows from every format datasets reads, loaded or streamed, named by file and line; column
renames, seeded shuffling of streamed sets, and one-line errors."""

import datasets
import huggingface_hub
import pytest
from dataset_rows import DatasetError, DatasetSpec, read_rows, without_nulls
from jsonl_files import write_jsonl

ROWS = [{"question": f"What is {i} + 1?", "answer": i + 1} for i in range(6)]


def write_dataset(tmp_path, kind: str) -> str:
    """ROWS as a user would store them: a JSONL, parquet or arrow file, a save_to_disk folder, or parquet shards."""
    if kind == "jsonl":
        return write_jsonl(tmp_path / "data.jsonl", ROWS)
    if kind == "parquet":
        datasets.Dataset.from_list(ROWS).to_parquet(tmp_path / "data.parquet")
        return str(tmp_path / "data.parquet")
    if kind in ("saved", "arrow"):  # arrow: the one arrow file save_to_disk wrote, read as a file
        datasets.Dataset.from_list(ROWS).save_to_disk(tmp_path / "saved")
        return str(tmp_path / "saved" / "data-00000-of-00001.arrow" if kind == "arrow" else tmp_path / "saved")
    (tmp_path / "shards").mkdir()
    datasets.Dataset.from_list(ROWS[:4]).to_parquet(tmp_path / "shards" / "part-0.parquet")
    datasets.Dataset.from_list(ROWS[4:]).to_parquet(tmp_path / "shards" / "part-1.parquet")
    (tmp_path / "shards" / ".cache").mkdir()  # what a download tool leaves beside the data: not read
    datasets.Dataset.from_list(ROWS[:1]).to_parquet(tmp_path / "shards" / ".cache" / "part-0.parquet")
    return str(tmp_path / "shards")


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("kind", ["jsonl", "parquet", "arrow", "saved", "shards"])
def test_every_format_gives_the_same_rows_loaded_or_streamed(tmp_path, kind, streaming):
    rows = list(read_rows(DatasetSpec(path=write_dataset(tmp_path, kind), streaming=streaming)))
    assert [row.data for row in rows] == ROWS


def test_rows_are_named_by_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", [ROWS[0], "", ROWS[1], "   ", ROWS[2]])
    assert [row.where for row in read_rows(DatasetSpec(path=path))] == [f"{path}:1", f"{path}:3", f"{path}:5"]
    shards = DatasetSpec(path=write_dataset(tmp_path, "shards"), streaming=True)
    first, second = tmp_path / "shards" / "part-0.parquet", tmp_path / "shards" / "part-1.parquet"
    expected = [f"{first}:{n}" for n in (1, 2, 3, 4)] + [f"{second}:{n}" for n in (1, 2)]
    assert [row.where for row in read_rows(shards)] == expected


def test_a_split_of_a_saved_dataset_dict(tmp_path):
    splits = {"train": datasets.Dataset.from_list(ROWS[:2]), "test": datasets.Dataset.from_list(ROWS[2:3])}
    datasets.DatasetDict(splits).save_to_disk(tmp_path / "saved")
    assert [row.data for row in read_rows(DatasetSpec(path=str(tmp_path / "saved"), split="test"))] == ROWS[2:3]
    with pytest.raises(DatasetError, match=r"saved: no split 'dev' \(splits: train, test\)$"):
        list(read_rows(DatasetSpec(path=str(tmp_path / "saved"), split="dev")))


@pytest.mark.parametrize("streaming", [False, True])
def test_columns_are_read_under_the_names_the_spec_gives(tmp_path, streaming):
    path = write_dataset(tmp_path, "parquet")
    spec = DatasetSpec(path=path, columns={"prompt": "question", "label": "answer"}, streaming=streaming)
    assert [row.data for row in read_rows(spec)][0] == {"prompt": "What is 0 + 1?", "label": 1}
    spec = DatasetSpec(path=path, columns={"prompt": "query"}, streaming=streaming)
    with pytest.raises(DatasetError, match=rf"^{path}:1: no column 'query' to read 'prompt' from \(columns: "):
        list(read_rows(spec))


def test_a_streamed_set_is_shuffled_by_seed_within_its_buffer(tmp_path):
    rows = [{"n": n} for n in range(40)]
    (tmp_path / "shards").mkdir()
    for shard in range(2):
        datasets.Dataset.from_list(rows[shard::2]).to_parquet(tmp_path / "shards" / f"part-{shard}.parquet")
    spec = DatasetSpec(path=str(tmp_path / "shards"), streaming=True, shuffle_buffer=8)

    def order(seed):
        return [row.data["n"] for row in read_rows(spec, shuffle_seed=seed)]

    assert order(0) == order(0)
    assert order(0) != order(1)
    assert sorted(order(0)) == list(range(40)) and order(0) != [row.data["n"] for row in read_rows(spec)]


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"question": "What is', r"invalid JSON \(Unterminated string .*\)"),
        ("[1, 2]", "expected a JSON object, got list"),
    ],
)
def test_a_line_that_is_not_a_json_object_is_named(tmp_path, streaming, line, message):
    path = write_jsonl(tmp_path / "data.jsonl", [ROWS[0], "", line, ROWS[1]])
    with pytest.raises(DatasetError, match=rf"^{path}:3: {message}$"):
        list(read_rows(DatasetSpec(path=path, streaming=streaming)))


@pytest.mark.parametrize("streaming", [False, True])
def test_an_empty_file_is_named_not_a_stopiteration(tmp_path, streaming):
    """datasets' JSON reader raises StopIteration looking for a first row (issue 40)."""
    path = write_jsonl(tmp_path / "data.jsonl", [])
    with pytest.raises(DatasetError, match=rf"^{path}: no rows \(an empty file\)$"):
        list(read_rows(DatasetSpec(path=path, streaming=streaming)))


@pytest.mark.parametrize("path", ["missing/data.jsonl", "./missing", "/no/such/folder", "a/b/c"])
def test_a_missing_local_path_is_one_clear_line(tmp_path, monkeypatch, path):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DatasetError) as error:
        list(read_rows(DatasetSpec(path=path)))
    assert str(error.value) == f"dataset {path!r} not found: no such file or folder, and not a hub dataset id"


def test_a_hub_id_goes_to_the_hub_and_an_unreachable_hub_is_one_clear_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # no hub here: fail at once, not after retries
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DatasetError) as error:
        list(read_rows(DatasetSpec(path="trident-org/arithmetic", split="test")))
    message = str(error.value)  # datasets' reason, or where the orchestrator's patches are installed, theirs
    assert message.startswith("hub dataset 'trident-org/arithmetic'") and "reach" in message and "\n" not in message


def test_a_file_of_another_format_is_refused(tmp_path):
    (tmp_path / "data.csv").write_text("question,answer\n")
    with pytest.raises(DatasetError, match=r"data\.csv: cannot read a \.csv file \(expected \.parquet/\.jsonl/"):
        list(read_rows(DatasetSpec(path=str(tmp_path / "data.csv"))))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match=r"empty: no \.parquet/\.jsonl/\.json/\.arrow files in the folder"):
        list(read_rows(DatasetSpec(path=str(tmp_path / "empty"))))


def test_without_nulls_gives_back_the_rows_as_written(tmp_path):
    # a table gives every message the keys any message has, null where it had none
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
    conversations = [
        [{"role": "user", "content": "2 + 3?"}, {"role": "assistant", "content": "", "tool_calls": [call]}],
        [{"role": "user", "content": "x?"}, {"role": "assistant", "content": "x", "reasoning_content": "..."}],
    ]
    datasets.Dataset.from_list([{"messages": m} for m in conversations]).to_parquet(tmp_path / "c.parquet")
    rows = list(read_rows(DatasetSpec(path=str(tmp_path / "c.parquet"))))
    assert rows[0].data["messages"][0] == {"role": "user", "content": "2 + 3?", "tool_calls": None,
                                           "reasoning_content": None}  # fmt: skip
    assert [without_nulls(row.data["messages"]) for row in rows] == conversations
