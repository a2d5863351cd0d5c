"""Conversations from parquet files and Hugging Face datasets directories, and source weights."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raysft.data.conversation import to_conversation
from raysft.data.sources import SourceError, copies, num_rows, source_sha256, table_records

MESSAGES = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
            for i in range(5)]
SHAREGPT = [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}
            for i in range(5)]


def test_parquet_rows_read_as_the_json_records_they_hold(tmp_path):
    pq.write_table(pa.Table.from_pylist(MESSAGES), tmp_path / "d.parquet", row_group_size=2)
    assert list(table_records(tmp_path / "d.parquet")) == list(enumerate(MESSAGES))
    assert list(table_records(tmp_path / "d.parquet", 1, 4)) == list(enumerate(MESSAGES))[1:4]  # across row groups
    assert num_rows(tmp_path / "d.parquet") == 5


def test_a_datasets_directory_reads_without_datasets_and_a_dataset_dict_names_its_splits(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(SHAREGPT).save_to_disk(tmp_path / "ds")
    rows = list(table_records(tmp_path / "ds"))
    assert rows == list(enumerate(SHAREGPT))
    assert [m["content"] for m in to_conversation(rows[2][1]).messages] == ["q2", "a2"]
    assert num_rows(tmp_path / "ds") == 5 and len(source_sha256(tmp_path / "ds")) == 64
    datasets.DatasetDict({"train": datasets.Dataset.from_list(SHAREGPT)}).save_to_disk(tmp_path / "dd")
    with pytest.raises(SourceError, match=r"dd is a DatasetDict: name one of its splits, e.g. .*dd/train"):
        list(table_records(tmp_path / "dd"))
    (tmp_path / "plain").mkdir()
    with pytest.raises(SourceError, match="not a Hugging Face dataset saved with save_to_disk"):
        list(table_records(tmp_path / "plain"))


@pytest.mark.parametrize("weight, low, high", [(0.5, 450, 550), (1.0, 1000, 1000), (2.0, 2000, 2000),
                                               (1.25, 1200, 1300)])
def test_a_weight_samples_a_source_deterministically(weight, low, high):
    counts = [copies(weight, "sha", i) for i in range(1000)]
    assert low <= sum(counts) <= high
    assert counts == [copies(weight, "sha", i) for i in range(1000)]  # the same records every time
    assert counts != [copies(weight, "other", i) for i in range(1000)] or weight == int(weight)


def test_system_prompt_opens_conversations_without_one():
    with_system = {"messages": [{"role": "system", "content": "Be kind."}, *MESSAGES[0]["messages"]]}
    assert to_conversation(MESSAGES[0], "Be brief.").messages[0] == {"role": "system", "content": "Be brief."}
    assert to_conversation(with_system, "Be brief.").messages[0]["content"] == "Be kind."
    assert json.dumps(to_conversation(MESSAGES[0]).messages) == json.dumps(MESSAGES[0]["messages"])
