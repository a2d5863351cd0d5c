import json

import pyarrow.parquet as pq
import pytest
from conftest import SHARED_DATASETS

from raysft.config import DataConfig, ModelConfig
from raysft.data import IGNORE_INDEX, DataError, prepare_store, read_manifest, to_messages, tokenize_messages
from raysft.demo import DEMO_CHAT_TEMPLATE
from raysft.tokenizer import VICUNA_TEMPLATE, load_tokenizer

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


def assistant_text(tok, labels):
    return tok.decode([t for t in labels if t != IGNORE_INDEX])


def test_labels_cover_exactly_every_assistant_turn(tok):
    ids, labels = tokenize_messages(tok, to_messages({"conversations": CONV}), 512)
    assert len(ids) == len(labels)
    assert assistant_text(tok, labels) == "2 plus 3 is 5.<|end|>The capital of Peru is Lima.<|end|>"
    # everything else, system and user text included, is masked
    masked = tok.decode([t for t, label in zip(ids, labels, strict=True) if label == IGNORE_INDEX])
    assert "Be brief." in masked and "What is 2 plus 3?" in masked and "Lima" not in masked


def test_sharegpt_and_openai_formats_tokenize_identically(tok):
    openai = {"messages": [{"role": {"human": "user", "gpt": "assistant"}.get(t["from"], t["from"]),
                            "content": t["value"]} for t in CONV]}
    sharegpt = {"conversations": CONV}
    assert tokenize_messages(tok, to_messages(openai), 512) == tokenize_messages(tok, to_messages(sharegpt), 512)


def test_truncation_keeps_the_start(tok):
    ids, labels = tokenize_messages(tok, to_messages({"conversations": CONV}), 512)
    short_ids, short_labels = tokenize_messages(tok, to_messages({"conversations": CONV}), 20)
    assert short_ids == ids[:20] and short_labels == labels[:20]


def test_templates_without_generation_blocks_mask_by_prefix(tok):
    """An assistant turn is what it adds to the rendering, so the template's separator after it ("\n") is
    learned too; everything else matches the {% generation %} mask."""
    messages = to_messages({"conversations": CONV})
    ids, _ = tokenize_messages(tok, messages, 512)
    tok_plain = load_tokenizer(ModelConfig())
    tok_plain.chat_template = DEMO_CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    plain_ids, plain_labels = tokenize_messages(tok_plain, messages, 512)
    assert plain_ids == ids
    assert assistant_text(tok_plain, plain_labels) == "2 plus 3 is 5.<|end|>\nThe capital of Peru is Lima.<|end|>\n"


def test_vicuna_template_is_used_when_the_tokenizer_has_none(tmp_path, tok):
    tok.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    vicuna = load_tokenizer(ModelConfig(tokenizer=str(tmp_path)))
    assert vicuna.chat_template == VICUNA_TEMPLATE
    ids, labels = tokenize_messages(vicuna, to_messages({"conversations": CONV}), 512)
    text = vicuna.decode(ids)
    assert text.startswith("Be brief. USER: What is 2 plus 3? ASSISTANT: 2 plus 3 is 5.<|end|> USER:")
    assert assistant_text(vicuna, labels) == " 2 plus 3 is 5.<|end|> The capital of Peru is Lima.<|end|>"


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
    counts = read_manifest(store.path)["counts"]
    assert store.num_samples == 2 and counts["records"] == 2 + len(BAD_RECORDS)
    assert counts["skipped"] == {reason: 1 for reason in BAD_RECORDS}


def test_invalid_json_file_names_the_file(tmp_path, tok):
    (tmp_path / "d.json").write_text('[{"conversations": []},')
    with pytest.raises(DataError, match=r"d\.json: not valid JSON"):
        prepare_store(DataConfig(paths=[str(tmp_path / "d.json")]), tok, tmp_path / "store")


def test_store_is_reused_and_rebuilt_when_input_or_tokenizer_changes(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD] * 3)
    cfg = DataConfig(paths=[str(path)])
    first = prepare_store(cfg, tok, tmp_path / "store")
    assert not first.reused and prepare_store(cfg, tok, tmp_path / "store").reused
    table = pq.read_table(first.path / "samples.parquet")
    assert table.num_rows == 3 and set(table.column_names) >= {"input_ids", "labels", "num_loss_tokens"}
    manifest = read_manifest(first.path)
    assert manifest["sources"][0]["path"] == str(path) and len(manifest["sources"][0]["sha256"]) == 64

    write_jsonl(path, [GOOD] * 4)  # changed input
    changed = prepare_store(cfg, tok, tmp_path / "store")
    assert not changed.reused and changed.path != first.path and changed.num_samples == 4
    other_tok = load_tokenizer(ModelConfig(), chat_template="vicuna")  # changed template
    assert not prepare_store(cfg, other_tok, tmp_path / "store").reused
    assert (first.path / "manifest.json").exists()  # older stores are never rewritten


@pytest.mark.skipif(not (SHARED_DATASETS / "fastchat").is_dir(), reason="../shared/datasets is not present")
def test_fastchat_dummy_conversations(tmp_path, tok):
    path = SHARED_DATASETS / "fastchat" / "dummy_conversation.json"
    store = prepare_store(DataConfig(paths=[str(path)], max_seq_len=512), tok, tmp_path / "store")
    assert store.num_samples == 500
    table = pq.read_table(store.path / "samples.parquet")
    assert min(table.column("num_loss_tokens").to_pylist()) > 0
    first = json.loads(path.read_text())[0]["conversations"]
    answers = "<|end|>".join(t["value"] for t in first if t["from"] == "gpt") + "<|end|>"
    row = table.slice(0, 1).to_pylist()[0]
    assert assistant_text(tok, row["labels"]) == answers
