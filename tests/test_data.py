import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import TEST_DATA

from raysft.config import DataConfig, ModelConfig
from raysft.data import (
    IGNORE_INDEX,
    DataError,
    StoreFull,
    prepare_store,
    read_store,
    read_store_manifest,
    store_files,
)
from raysft.data.conversation import to_conversation
from raysft.data.demo import DEMO_CONVERSATIONS
from raysft.data.labels import label_conversation
from raysft.data.tokenizer import VICUNA_SYSTEM, VICUNA_TEMPLATE, load_tokenizer, tokenizer_fingerprint

FASTCHAT = TEST_DATA / "fastchat" / "dummy_conversation.json"  # 500 ShareGPT conversations from FastChat

CONV = [
    {"from": "system", "value": "Be brief."},
    {"from": "human", "value": "What is 2 plus 3?"},
    {"from": "gpt", "value": "2 plus 3 is 5."},
    {"from": "human", "value": "And the capital of Peru?"},
    {"from": "gpt", "value": "The capital of Peru is Lima."},
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ModelConfig())


def tokenize_messages(tok, record, max_seq_len):
    out = label_conversation(tok, to_conversation(record), max_seq_len)
    return out.input_ids, out.labels


def assistant_text(tok, labels):
    return tok.decode([t for t in labels if t != IGNORE_INDEX])


def test_labels_cover_exactly_every_assistant_turn(tok):
    ids, labels = tokenize_messages(tok, {"conversations": CONV}, 512)
    assert len(ids) == len(labels)
    assert assistant_text(tok, labels) == "2 plus 3 is 5.<|end|>The capital of Peru is Lima.<|end|>"
    # everything else, system and user text included, is masked
    masked = tok.decode([t for t, label in zip(ids, labels, strict=True) if label == IGNORE_INDEX])
    assert "Be brief." in masked and "What is 2 plus 3?" in masked and "Lima" not in masked


def test_sharegpt_and_openai_formats_tokenize_identically(tok):
    openai = {"messages": [{"role": {"human": "user", "gpt": "assistant"}.get(t["from"], t["from"]),
                            "content": t["value"]} for t in CONV]}
    sharegpt = {"conversations": CONV}
    assert tokenize_messages(tok, openai, 512) == tokenize_messages(tok, sharegpt, 512)


def test_truncation_keeps_the_start(tok):
    ids, labels = tokenize_messages(tok, {"conversations": CONV}, 512)
    short_ids, short_labels = tokenize_messages(tok, {"conversations": CONV}, 20)
    assert short_ids == ids[:20] and short_labels == labels[:20]


def test_vicuna_template_is_used_when_the_tokenizer_has_none(tmp_path, tok):
    tok.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    vicuna = load_tokenizer(ModelConfig(tokenizer=str(tmp_path)))
    assert vicuna.chat_template == VICUNA_TEMPLATE
    ids, labels = tokenize_messages(vicuna, {"conversations": CONV}, 512)
    assert vicuna.decode(ids) == fastchat_vicuna_v1_1(CONV, eos="<|end|>")
    # the demo BPE reads "ASSISTANT: 2" as "ASSISTANT:", " 2": that answer's first token carries the space
    assert assistant_text(vicuna, labels) == " 2 plus 3 is 5.<|end|>The capital of Peru is Lima.<|end|>"
    # without a system message, FastChat's own
    no_system = tokenize_messages(vicuna, {"conversations": CONV[1:]}, 512)[0]
    assert vicuna.decode(no_system) == fastchat_vicuna_v1_1(CONV[1:], eos="<|end|>")


def fastchat_vicuna_v1_1(turns, eos):
    """FastChat's Conversation.get_prompt for vicuna_v1.1 (SeparatorStyle.ADD_COLON_TWO, sep " ", sep2 "</s>")."""
    system = turns[0]["value"] if turns[0]["from"] == "system" else VICUNA_SYSTEM
    seps = [" ", eos]
    ret = system + seps[0]
    for i, turn in enumerate(t for t in turns if t["from"] != "system"):
        ret += {"human": "USER", "gpt": "ASSISTANT"}[turn["from"]] + ": " + turn["value"] + seps[i % 2]
    return ret


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


GOOD = {"conversations": CONV[1:3]}
BAD_RECORDS = {
    "invalid_json": '{"conversations": [',
    "unknown_role": {"conversations": [{"from": "bot", "value": "hi"}, {"from": "gpt", "value": "x"}]},
    "empty_conversation": {"conversations": []},
    "no_assistant_turn": {"messages": [{"role": "user", "content": "hi"}]},
    "non_string_content": {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": 3}]},
    "bad_structure": {"text": "no conversation here"},
}


@pytest.mark.parametrize("reason", BAD_RECORDS)
def test_bad_record_error_names_file_and_record(tmp_path, tok, reason):
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD, GOOD, BAD_RECORDS[reason]])
    with pytest.raises(DataError, match=r"d\.jsonl: record 2: ") as e:
        prepare_store(DataConfig(paths=[str(path)]), tok, tmp_path / "store")
    assert "on_bad_record=skip" in str(e.value)
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").iterdir())


def test_skip_counts_bad_records_per_reason(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD, *BAD_RECORDS.values(), GOOD])
    store = prepare_store(DataConfig(paths=[str(path)], on_bad_record="skip"), tok, tmp_path / "store")
    counts = read_store_manifest(store.path)["counts"]
    assert store.num_samples == 2 and counts["records"] == 2 + len(BAD_RECORDS)
    assert counts["skipped"] == {reason: 1 for reason in BAD_RECORDS}


def test_invalid_json_file_names_the_file(tmp_path, tok):
    (tmp_path / "d.json").write_text('[{"conversations": []},')
    with pytest.raises(DataError, match=r"d\.json: not valid JSON"):
        prepare_store(DataConfig(paths=[str(tmp_path / "d.json")]), tok, tmp_path / "store")


def write_table(path, records):
    """A parquet file, or a `datasets` directory (no suffix), of records: every key a column (null where a record
    lacks it), as a Hugging Face dataset of mixed rows has them."""
    columns = {key: [r.get(key) for r in records] for key in dict.fromkeys(k for r in records for k in r)}
    if path.suffix == ".parquet":
        pq.write_table(pa.table(columns), path)
    else:
        pytest.importorskip("datasets").Dataset.from_dict(columns).save_to_disk(path)
    return path


# invalid_json cannot occur in a table; a null content is what a table holds where JSON has a number
TABLE_BAD_RECORDS = {**{k: v for k, v in BAD_RECORDS.items() if k != "invalid_json"},
                     "non_string_content": {"messages": [{"role": "user", "content": None},
                                                         {"role": "assistant", "content": "x"}]}}


@pytest.mark.parametrize("suffix", [".parquet", ""])
def test_bad_rows_of_parquet_and_datasets_sources_get_the_errors_of_json_records(tmp_path, tok, suffix):
    """The same message as the same record in a JSONL file, naming the table and the row; skip counts them alike."""
    for reason, bad in TABLE_BAD_RECORDS.items():
        table = write_table(tmp_path / f"{reason}{suffix}", [GOOD, GOOD, bad])
        jsonl = write_jsonl(tmp_path / f"{reason}.jsonl", [GOOD, GOOD, bad])
        messages = []
        for path in (table, jsonl):
            with pytest.raises(DataError) as e:
                prepare_store(DataConfig(paths=[str(path)]), tok, tmp_path / "store")
            messages.append(str(e.value).replace(str(path), "SOURCE"))
        assert messages[0].startswith("SOURCE: record 2: ") and messages[0] == messages[1], reason
    mixed = write_table(tmp_path / f"mixed{suffix}", [GOOD, *TABLE_BAD_RECORDS.values(), GOOD])
    store = prepare_store(DataConfig(paths=[str(mixed)], on_bad_record="skip"), tok, tmp_path / "store")
    assert store.num_samples == 2 and read_store_manifest(store.path)["counts"]["skipped"] == dict.fromkeys(
        TABLE_BAD_RECORDS, 1)


def test_a_table_source_pyarrow_cannot_open_is_a_data_error_naming_the_file(tmp_path, tok):
    good = write_table(tmp_path / "d.parquet", [GOOD] * 3)
    (tmp_path / "cut.parquet").write_bytes(good.read_bytes()[:-20])  # a copy cut short: no footer
    ds = write_table(tmp_path / "ds", [GOOD] * 3)
    arrow = next(ds.glob("*.arrow"))
    arrow.write_bytes(b"not arrow")
    for path, message in ((tmp_path / "cut.parquet", f"{tmp_path / 'cut.parquet'}: not a readable parquet file"),
                          (ds, f"{arrow}: not a readable Arrow file")):
        with pytest.raises(DataError, match=re.escape(f"data.paths: {message}")):
            prepare_store(DataConfig(paths=[str(path)]), tok, tmp_path / "store")


def test_store_is_reused_and_rebuilt_when_input_or_tokenizer_changes(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD] * 3)
    cfg = DataConfig(paths=[str(path)])
    first = prepare_store(cfg, tok, tmp_path / "store")
    assert not first.reused and prepare_store(cfg, tok, tmp_path / "store").reused
    table = pq.read_table(first.path / "samples.parquet")
    assert table.num_rows == 3 and set(table.column_names) >= {"input_ids", "labels", "num_loss_tokens"}
    manifest = read_store_manifest(first.path)
    assert manifest["sources"][0]["path"] == str(path) and len(manifest["sources"][0]["sha256"]) == 64

    write_jsonl(path, [GOOD] * 4)  # changed input
    changed = prepare_store(cfg, tok, tmp_path / "store")
    assert not changed.reused and changed.path != first.path and changed.num_samples == 4
    other_tok = load_tokenizer(ModelConfig(), chat_template="vicuna")  # changed template
    assert not prepare_store(cfg, other_tok, tmp_path / "store").reused
    assert (first.path / "manifest.json").exists()  # older stores are never rewritten


def test_fastchat_dummy_conversations(tmp_path, tok):
    store = prepare_store(DataConfig(paths=[str(FASTCHAT)], max_seq_len=512), tok, tmp_path / "store")
    assert store.num_samples == 500
    table = pq.read_table(store.path / "samples.parquet")
    assert min(table.column("num_loss_tokens").to_pylist()) > 0
    first = json.loads(FASTCHAT.read_text())[0]["conversations"]
    answers = "<|end|>".join(t["value"] for t in first if t["from"] == "gpt") + "<|end|>"
    row = table.slice(0, 1).to_pylist()[0]
    assert assistant_text(tok, row["labels"]) == answers


# --- the Ray Data path: the same store as the local one -----------------------------------------------------------



@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of a few KiB, so that every test file is cut into several Ray tasks, mid-file."""
    import raysft.data.tokenize_ray

    monkeypatch.setattr(raysft.data.tokenize_ray, "MIN_CHUNK_BYTES", 4096)
    monkeypatch.setattr(raysft.data.tokenize_ray, "CHUNK_BYTES", 16384)


def prepare_both(tok, tmp_path, paths, split="train", **data):
    paths = [p if isinstance(p, dict) else str(p) for p in paths]
    local = prepare_store(DataConfig(paths=paths, prepare="local", **data), tok, tmp_path / "local", split)
    on_ray = prepare_store(DataConfig(paths=paths, prepare="ray", **data), tok, tmp_path / "ray", split)
    assert (local.built_with, on_ray.built_with) == ("local", "ray")
    return local, on_ray


def assert_same_store(local, on_ray):
    assert on_ray.path.name == local.path.name and on_ray.num_samples == local.num_samples
    assert len(store_files(on_ray.path)) > 1  # really cut into chunks
    assert read_store(on_ray.path).equals(read_store(local.path))  # rows, order, columns, values
    assert (on_ray.path / "manifest.json").read_text() == (local.path / "manifest.json").read_text()


def bad_copy(path, tmp_path, bad: dict[int, object]):
    """A JSON-array data file with some records replaced by bad ones."""
    records = json.loads(path.read_text())
    for index, record in bad.items():
        records[index] = record
    out = tmp_path / f"bad-{path.name}"
    out.write_text(json.dumps(records, indent=1, ensure_ascii=False))
    return out


def test_ray_store_equals_local_store_on_the_demo_data(tmp_path, tok, ray_cluster, small_chunks):
    assert_same_store(*prepare_both(tok, tmp_path, ["builtin:demo"]))


def test_ray_store_equals_local_store_on_fastchat_data(tmp_path, tok, ray_cluster, small_chunks):
    local, on_ray = prepare_both(tok, tmp_path, [FASTCHAT, "builtin:demo"], max_seq_len=24, on_bad_record="skip")
    assert_same_store(local, on_ray)
    counts = read_store_manifest(on_ray.path)["counts"]
    assert counts["truncated"] > 0 and counts["skipped"]  # short max_seq_len: truncations and empty samples


def test_ray_store_equals_local_store_on_weighted_parquet_and_datasets_sources(tmp_path, tok, ray_cluster,
                                                                              small_chunks):
    """Table sources are cut by rows; weights sample the same records on either path."""
    datasets = pytest.importorskip("datasets")
    demo = json.loads(DEMO_CONVERSATIONS.read_text())
    pq.write_table(pa.Table.from_pylist(demo[:300]), tmp_path / "d.parquet", row_group_size=64)
    datasets.Dataset.from_list(demo[300:600]).save_to_disk(tmp_path / "ds")
    local, on_ray = prepare_both(tok, tmp_path, [{"path": str(tmp_path / "d.parquet"), "weight": 0.5},
                                                 {"path": str(tmp_path / "ds"), "weight": 1.5}],
                                 system_prompt="Be brief.")
    assert_same_store(local, on_ray)
    counts = read_store_manifest(local.path)["counts"]
    assert counts["records"] == 600 and 120 < counts["weighted_out"] < 180  # about half the parquet's 300
    assert 300 - counts["weighted_out"] + 300 < counts["samples"] < 600 + 300  # the datasets source 1.5 times
    sources = read_store_manifest(local.path)["sources"]
    assert [s.get("weight") for s in sources] == [0.5, 1.5]


def test_ray_holds_out_the_same_eval_records_as_the_local_path(tmp_path, tok, ray_cluster, small_chunks):
    """data.eval_fraction on Ray: both splits equal the local ones, and no record is in both."""
    pq.write_table(pa.Table.from_pylist(json.loads(DEMO_CONVERSATIONS.read_text())[:300]), tmp_path / "d.parquet",
                   row_group_size=64)
    records = []
    for split in ("train", "eval"):
        local, on_ray = prepare_both(tok, tmp_path / split, [{"path": str(tmp_path / "d.parquet"), "weight": 1.5}],
                                     split=split, eval_fraction=0.1)
        assert_same_store(local, on_ray)
        records.append(set(read_store(local.path, ["record"])["record"].to_pylist()))
    assert not records[0] & records[1] and len(records[0] | records[1]) == 300


def test_ray_skips_the_same_bad_records(tmp_path, tok, ray_cluster, small_chunks):
    data = bad_copy(FASTCHAT, tmp_path, {3: BAD_RECORDS["unknown_role"], 250: {"conversations": []},
                                         251: BAD_RECORDS["no_assistant_turn"], 499: "not an object"})
    jsonl = write_jsonl(tmp_path / "d.jsonl", [GOOD, "", *BAD_RECORDS.values(), "  \t", GOOD] * 20)
    local, on_ray = prepare_both(tok, tmp_path, [data, jsonl], on_bad_record="skip")
    assert_same_store(local, on_ray)
    counts = read_store_manifest(on_ray.path)["counts"]
    assert counts["records"] == 500 + 20 * (2 + len(BAD_RECORDS)) and on_ray.num_samples == 496 + 40
    assert counts["skipped"] == {"unknown_role": 21, "empty_conversation": 21, "no_assistant_turn": 21,
                                 "bad_structure": 21, "invalid_json": 20, "non_string_content": 20}


def ray_error(tok, tmp_path, paths) -> str:
    """The DataError message of both paths, checked equal, with nothing left in either store root."""
    messages = []
    for prepare in ("local", "ray"):
        root = tmp_path / prepare
        with pytest.raises(DataError) as e:
            prepare_store(DataConfig(paths=[str(p) for p in paths], prepare=prepare), tok, root)
        assert not any(root.iterdir())
        messages.append(str(e.value))
    assert messages[0] == messages[1]
    return messages[0]


def test_ray_reports_the_first_bad_record_as_the_local_path_does(tmp_path, tok, ray_cluster, small_chunks):
    data = bad_copy(FASTCHAT, tmp_path, {400: {"conversations": []}, 480: BAD_RECORDS["unknown_role"]})
    assert ray_error(tok, tmp_path, [FASTCHAT, data]).startswith(f"{data}: record 400: 'conversations' is empty")
    lines = [GOOD] * 300 + ["", BAD_RECORDS["invalid_json"], GOOD, BAD_RECORDS["bad_structure"]]
    jsonl = write_jsonl(tmp_path / "d.jsonl", lines)
    assert ray_error(tok, tmp_path, ["builtin:demo", jsonl]).startswith(
        f"{jsonl}: record 300: line 302 is not valid JSON: ")


def test_ray_meets_an_unreadable_file_where_the_local_path_does(tmp_path, tok, ray_cluster, small_chunks):
    broken = tmp_path / "broken.json"
    broken.write_text('[{"conversations": []},')
    bad_first = write_jsonl(tmp_path / "a.jsonl", [GOOD] * 100 + [BAD_RECORDS["empty_conversation"]])
    assert ray_error(tok, tmp_path, [bad_first, broken]).startswith(f"{bad_first}: record 100: ")
    good = write_jsonl(tmp_path / "b.jsonl", [GOOD] * 100)
    assert ray_error(tok, tmp_path, [good, broken]).startswith(f"{broken}: not valid JSON")


def test_jsonl_lines_read_the_same_cut_anywhere(tmp_path, tok, ray_cluster, small_chunks, monkeypatch):
    """Blank lines (also Unicode blanks), CRLF endings and bytes that are not UTF-8, cut into chunks mid-file; the
    path is relative to the driver's directory, not the Ray workers'."""
    good = json.dumps(GOOD).encode()
    lines = [good + b"\r\n", b"\r\n", "\u00a0\u3000\n".encode(), good + b"\n", b"\xff" + good + b"\n",
             '{"messages": [{"role": "user", "content": "h\u00e9"}, {"role": "assistant", "content": "\u00e7a"}]}\n'
             .encode()] * 150
    (tmp_path / "d.jsonl").write_bytes(b"".join(lines) + good)  # no newline at the end
    monkeypatch.chdir(tmp_path)
    local, on_ray = prepare_both(tok, tmp_path, ["d.jsonl"], on_bad_record="skip")
    assert_same_store(local, on_ray)
    assert read_store_manifest(on_ray.path)["counts"]["skipped"] == {"invalid_json": 150}
    assert read_store(on_ray.path).column("source")[0].as_py() == "d.jsonl"
    assert read_store(on_ray.path).column("record").to_pylist()[-3:] == [597, 599, 600]


def test_auto_prepares_on_ray_only_for_large_inputs_when_ray_is_there(tmp_path, tok, ray_cluster, monkeypatch):
    import ray

    import raysft.data.tokenize_ray

    data = DataConfig(paths=["builtin:demo"])  # prepare: auto
    assert prepare_store(data, tok, tmp_path / "a").built_with == "local"  # 390 kB: not worth Ray
    monkeypatch.setattr(raysft.data.tokenize_ray, "RAY_MIN_BYTES", 1000)
    assert prepare_store(data, tok, tmp_path / "b").built_with == "ray"
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert prepare_store(data, tok, tmp_path / "c").built_with == "local"  # no cluster: none is started for it


def test_json_array_spans_agree_with_json_loads():
    from raysft.data.readers import json_array_spans as _json_array_spans

    text = ' \n[ {"a": "]", "b": [1, {"c": "\\","}]} ,\r\n"x" ,3.5e2, null,[] ]\n '
    spans = _json_array_spans(text)
    assert [json.loads(text[a:b]) for a, b in spans] == json.loads(text)
    assert _json_array_spans("[]") == [] and _json_array_spans(" [ ] ") == []
    for not_an_array in ('{"a": 1}', "[1,]", "[1 2]", "[1] x", "", "[", "[1,2"):
        assert _json_array_spans(not_an_array) is None
    assert _json_array_spans("\ufeff[1]") == [(2, 3)]  # a BOM before the array is read past, as json_array does


def test_a_ray_task_that_cannot_see_the_input_says_what_to_do(tmp_path, tok):
    from dataclasses import asdict

    from raysft.data.tokenize_ray import _Chunk, _tokenize_chunks

    chunk = _Chunk(0, str(tmp_path / "elsewhere.jsonl"), "elsewhere.jsonl", jsonl=True, start=0, end=10, index=0)
    out = _tokenize_chunks({"chunk": [json.dumps(asdict(chunk))]}, tok, tokenizer_fingerprint(tok), DataConfig(),
                           str(tmp_path))
    error = json.loads(out["result"][0])["error"]
    assert "elsewhere.jsonl: not found on " in error and "a shared mount), or set data.prepare=local" in error


@pytest.fixture
def small_disk(tmp_path):
    """A 32 KiB tmpfs: a real disk that fills before the demo's store (about 44 KiB) is written. Mounting needs
    root; the test is skipped where the machine does not allow it."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32k", "tmpfs", str(disk)], capture_output=True,
                             text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_full_store_disk_is_named_and_with_space_again_a_whole_store_is_written(tmp_path, tok, small_disk):
    """ENOSPC during prepare: StoreFull naming data.store_dir, no torn store left to be reused, the directory's
    other files kept; after space is freed the next prepare writes the store every launch would have written."""
    fill_then_free(tmp_path, tok, small_disk, "local")


def test_a_full_store_disk_met_by_ray_data_tasks_is_named_and_leaves_no_torn_store(tmp_path, tok, small_disk,
                                                                                   ray_cluster, small_chunks):
    fill_then_free(tmp_path, tok, small_disk, "ray")


def fill_then_free(tmp_path, tok, small_disk, prepare: str) -> None:
    cfg = DataConfig(paths=["builtin:demo"], prepare=prepare)
    root = small_disk / "stores"
    root.mkdir()
    (root / "notes.txt").write_text("kept")
    with pytest.raises(StoreFull, match=f"data.store_dir: {root} is full \\(No space left on device\\) while the "
                                        "store [0-9a-f]{20} was written"):
        prepare_store(cfg, tok, root)
    assert [p.name for p in root.iterdir()] == ["notes.txt"] and (root / "notes.txt").read_text() == "kept"
    subprocess.run(["mount", "-o", "remount,size=4m", str(small_disk)], check=True)  # space again
    store = prepare_store(cfg, tok, root)
    expected = prepare_store(DataConfig(paths=["builtin:demo"], prepare="local"), tok, tmp_path / "elsewhere")
    assert not store.reused and store.path.name == expected.path.name
    assert read_store(store.path).equals(read_store(expected.path))
    assert read_store_manifest(store.path) == read_store_manifest(expected.path)


NOTHING_TO_LEARN = {
    "without_assistant_turns": ([BAD_RECORDS["no_assistant_turn"]] * 3, {"on_bad_record": "skip"},
                                "3 records read; skipped with data.on_bad_record=skip: 3 no_assistant_turn (a record "
                                "without an assistant turn has nothing to learn)"),
    "answers_cut_by_max_seq_len": ([GOOD] * 3, {"on_bad_record": "skip", "max_seq_len": 8},
                                   "3 records read; skipped with data.on_bad_record=skip: 3 "
                                   "no_assistant_tokens_after_truncation (raise data.max_seq_len: it keeps the start "
                                   "of each conversation)"),
    "no_records": ([], {}, "0 records read"),
    "weighted_out": ([GOOD] * 3, {"weight": 0.01}, "3 records read; 3 left out by a source weight below 1"),
}


@pytest.mark.parametrize("case", NOTHING_TO_LEARN)
def test_data_with_nothing_to_learn_is_a_data_error_naming_the_files_and_why(tmp_path, tok, ray_cluster,
                                                                               small_chunks, case):
    """Refused at prepare, by both paths alike, with what to change; no store is left."""
    records, sets, why = NOTHING_TO_LEARN[case]
    path = write_jsonl(tmp_path / "d.jsonl", records)
    weight = sets.pop("weight", 1)
    for prepare in ("local", "ray"):
        cfg = DataConfig(paths=[{"path": str(path), "weight": weight}], prepare=prepare, **sets)
        with pytest.raises(DataError) as e:
            prepare_store(cfg, tok, tmp_path / prepare)
        assert str(e.value) == f"no record of {path} has anything to learn: {why}"
        assert not any((tmp_path / prepare).iterdir())


BUILD_IN_A_CHILD = """
import os, signal, sys, time
from pathlib import Path
import raysft.data.prepare as prepare
from raysft.config import DataConfig, ModelConfig
from raysft.data.tokenizer import load_tokenizer

data, store, how = sys.argv[1:]
tokenize = prepare._tokenize_here

def tokenize_then(cfg, tok, sources, out, *args):
    (Path(store) / "building").write_text(str(out))
    if how == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
    while not (Path(store) / "go").exists():
        time.sleep(0.05)
    return tokenize(cfg, tok, sources, out, *args)

prepare._tokenize_here = tokenize_then
print(prepare.prepare_store(DataConfig(paths=[data]), load_tokenizer(ModelConfig()), Path(store)).reused)
"""


def build_in_a_child(data: Path, store: Path, how: str) -> subprocess.Popen:
    """prepare_store in another process, which stops inside the build (its directory made, in it) and then is
    killed with SIGKILL ("killed") or waits for a file `go` in the store root ("waits")."""
    store.mkdir(exist_ok=True)
    return subprocess.Popen([sys.executable, "-c", BUILD_IN_A_CHILD, str(data), str(store), how],
                            stdout=subprocess.PIPE, text=True)


def wait_for_file(path: Path, child: subprocess.Popen) -> str:
    deadline = time.monotonic() + 120
    while not path.is_file():
        assert time.monotonic() < deadline and child.poll() in (None, -signal.SIGKILL), "the child never built"
        time.sleep(0.05)
    return path.read_text()


def test_a_prepare_killed_mid_build_leaves_a_directory_the_next_prepare_removes(tmp_path, tok):
    data, store = write_jsonl(tmp_path / "d.jsonl", [GOOD] * 3), tmp_path / "store"
    child = build_in_a_child(data, store, "killed")
    leftover = Path(wait_for_file(store / "building", child))
    assert child.wait(60) == -signal.SIGKILL and leftover.is_dir()  # SIGKILL: nothing ran to remove it
    theirs = [store / ".not-raysfts", store / f".{leftover.name.split('.')[1]}.kept-by-a-user"]
    for d in theirs:
        d.mkdir()
    built = prepare_store(DataConfig(paths=[str(data)]), tok, store)
    assert not leftover.exists() and all(d.is_dir() for d in theirs)  # only raysft's own build directories
    assert not built.reused and read_store_manifest(built.path)["counts"]["samples"] == 3
    assert sorted(p.name for p in store.iterdir()) == sorted([built.path.name, "building", *(d.name for d in theirs)])


@pytest.mark.slow  # two tokenizing processes at once (seconds on 2 cores): make test-fast leaves it out
def test_two_prepares_of_one_store_at_once_never_remove_each_others_build(tmp_path, tok):
    data, store = write_jsonl(tmp_path / "d.jsonl", [GOOD] * 3), tmp_path / "store"
    child = build_in_a_child(data, store, "waits")
    theirs = Path(wait_for_file(store / "building", child))
    mine = prepare_store(DataConfig(paths=[str(data)]), tok, store)  # builds and renames while the child builds
    assert theirs.is_dir() and not mine.reused
    (store / "go").touch()
    out, _ = child.communicate(timeout=120)
    assert child.returncode == 0 and out.strip() == "True"  # it found the same store finished first: reused
    assert not theirs.exists() and sorted(p.name for p in store.iterdir() if p.name not in ("building", "go")) == \
        [mine.path.name]  # no build directory and no lock file left
