"""Small mistakes a user makes in data, tokenizer and metrics files: each is accepted as meant or refused with a
message that names the key and the file (Ray-free)."""

import json
import shutil

import pytest

from raysft.config import ConfigError, ModelConfig, load_config
from raysft.data.demo import DEMO_TOKENIZER
from raysft.data.readers import read_records
from raysft.data.tokenizer import load_tokenizer
from raysft.tools.report import read_curves

RECORDS = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "höla"}]},
           {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}]


@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_a_utf8_bom_at_the_start_of_a_data_file_is_accepted(tmp_path, suffix):
    path = tmp_path / f"bom{suffix}"
    text = json.dumps(RECORDS) if suffix == ".json" else "".join(json.dumps(r) + "\n" for r in RECORDS)
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert [r for _, r in read_records(path)] == RECORDS


def test_a_bom_file_makes_the_same_store_locally_and_on_ray_chunks(tmp_path):
    """data.prepare=ray cuts files into byte ranges; the BOM's 3 bytes must not shift them."""
    from raysft.data.tokenize_ray import _Chunk, _chunk_records, _json_chunks

    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(RECORDS * 5).encode())
    spans = _json_chunks(path, chunk_bytes=200)
    assert len(spans) > 1
    read = [r for i, span in enumerate(spans) for _, r in _chunk_records(_Chunk(i, str(path), str(path), **span))]
    assert read == RECORDS * 5


def test_the_same_file_listed_twice_in_data_paths_is_refused(tmp_path):
    data = tmp_path / "a.jsonl"
    data.write_text("")
    with pytest.raises(ConfigError, match=r"data\.paths.*the same file twice"):
        load_config(None, [f"data.paths=[{data}, {tmp_path}/./a.jsonl]"])
    with pytest.raises(ConfigError, match=r"data\.paths"):
        load_config(None, ["data.paths=[builtin:demo, builtin:demo]"])


def test_a_mistyped_chat_template_path_names_the_key_and_the_path(tmp_path):
    """A config error, which ends a run at once where a worker meets it (no restart finds the file)."""
    with pytest.raises(ConfigError, match=f"config key 'data.chat_template': cannot read {tmp_path}/vicnua.jinja"):
        load_tokenizer(ModelConfig(), chat_template=str(tmp_path / "vicnua.jinja"))
    with pytest.raises(ConfigError, match="data.chat_template"):
        load_tokenizer(ModelConfig(), chat_template="vicnua")


def test_a_tokenizer_directory_without_a_vocabulary_names_the_directory(tmp_path):
    shutil.copy(DEMO_TOKENIZER / "tokenizer_config.json", tmp_path)
    with pytest.raises(ConfigError, match=f"config key 'model.tokenizer': {tmp_path} has no tokenizer vocabulary .*"
                                          r"it holds \['tokenizer_config.json'\]"):
        load_tokenizer(ModelConfig(tokenizer=str(tmp_path)))


def test_a_missing_tokenizer_directory_is_a_config_error_naming_the_key_the_user_set(tmp_path):
    """model.path when model.tokenizer is empty (the DPO demo's config): the key that names the directory."""
    with pytest.raises(ConfigError, match=f"config key 'model.path': {tmp_path}/demo-model is not a directory "
                                          "with a Hugging Face tokenizer"):
        load_tokenizer(ModelConfig(path=str(tmp_path / "demo-model"), tokenizer=""))
    with pytest.raises(ConfigError, match="config key 'model.tokenizer': unknown builtin 'builtin:nope'"):
        load_tokenizer(ModelConfig(tokenizer="builtin:nope"))


def test_report_skips_and_counts_rows_without_a_loss(tmp_path):
    rows = [{"step": 1, "loss": 2.0, "tokens_per_s": 10.0}, {"step": 2}, {"step": 3, "loss": "high"}, [1, 2],
            {"event": "resume"}, {"step": 4, "loss": 1.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    curves = read_curves(tmp_path)
    assert list(curves.steps) == [1, 4] and curves.unreadable_lines == 4
    assert curves.summary().startswith("2 steps (last 4), final loss 1.5000, median 10 tokens/s")
