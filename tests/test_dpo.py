"""DPO on raysft's rails without Ray: preference records in each format into pair rows labelled on the answers only,
the named refusals, stores that never mix with SFT's, the per-sequence log-probabilities of a packed row, exact
resume with the reference log-probabilities reused, and LoRA's reference (the adapters off). The comparison with
TRL: tests/test_dpo_trl.py."""

import json

import pytest
import torch
from conftest import final_weights, tiny_config

from raysft.config import DataConfig, ModelConfig
from raysft.data import IGNORE_INDEX, prepare_store, read_store, read_store_manifest
from raysft.data.conversation import BadRecord
from raysft.data.dataloader import TokenizedDataset, collate, pair_rows
from raysft.data.preference import SkippedPair, label_pair, to_pair
from raysft.data.tokenizer import load_tokenizer
from raysft.errors import DataError
from raysft.launch.torchrun import launch
from raysft.model.preference_loss import pair_losses, sequence_loss_inputs
from raysft.training.metrics import read_metrics


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ModelConfig(), "auto")


def answer_text(tok, row) -> str:
    return tok.decode([t for t in row.labels if t != IGNORE_INDEX])


QUESTION, RIGHT, WRONG = "What is 2 plus 2?", "2 plus 2 is 4.", "2 plus 2 is 5."
FORMATS = {
    "trl plain text": {"prompt": QUESTION, "chosen": RIGHT, "rejected": WRONG},
    "trl conversational": {"prompt": [{"role": "user", "content": QUESTION}],
                           "chosen": [{"role": "assistant", "content": RIGHT}],
                           "rejected": [{"role": "assistant", "content": WRONG}]},
    "ultrafeedback": {"prompt": QUESTION, "chosen": [{"role": "user", "content": QUESTION},
                                                     {"role": "assistant", "content": RIGHT}],
                      "rejected": [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": WRONG}]},
    "hh-rlhf text": {"chosen": f"\n\nHuman: {QUESTION}\n\nAssistant: {RIGHT}",
                     "rejected": f"\n\nHuman: {QUESTION}\n\nAssistant: {WRONG}"},
    "sharegpt full": {"chosen": [{"from": "human", "value": QUESTION}, {"from": "gpt", "value": RIGHT}],
                      "rejected": [{"from": "human", "value": QUESTION}, {"from": "gpt", "value": WRONG}]},
}


@pytest.mark.parametrize("name", FORMATS)
def test_every_format_renders_one_prompt_and_labels_only_the_answers(tok, name):
    chosen, rejected = label_pair(tok, to_pair(FORMATS[name]), 512)
    assert answer_text(tok, chosen) == RIGHT + "<|end|>" and answer_text(tok, rejected) == WRONG + "<|end|>"
    first = chosen.labels.index(next(t for t in chosen.labels if t != IGNORE_INDEX))
    assert tok.decode(chosen.input_ids[:first]) == f"<|user|>\n{QUESTION}<|end|>\n<|assistant|>\n"
    assert chosen.input_ids[:first] == rejected.input_ids[:first]


def test_a_multi_turn_prompt_keeps_its_assistant_turns_unlabelled(tok):
    history = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."},
               {"role": "user", "content": QUESTION}]
    chosen, rejected = label_pair(tok, to_pair({"chosen": [*history, {"role": "assistant", "content": RIGHT}],
                                                "rejected": [*history, {"role": "assistant", "content": WRONG}]}), 512)
    assert answer_text(tok, chosen) == RIGHT + "<|end|>" and answer_text(tok, rejected) == WRONG + "<|end|>"


@pytest.mark.parametrize(("record", "reason"), [
    ({"prompt": QUESTION, "chosen": RIGHT, "rejected": RIGHT}, "identical_answers"),
    ({"chosen": [{"role": "user", "content": "A?"}, {"role": "assistant", "content": RIGHT}],
      "rejected": [{"role": "user", "content": "B?"}, {"role": "assistant", "content": WRONG}]}, "prompt_mismatch"),
    ({"prompt": QUESTION, "chosen": RIGHT * 40, "rejected": WRONG}, "answer_truncated"),
    ({"prompt": QUESTION * 20, "chosen": RIGHT, "rejected": WRONG}, "prompt_too_long"),
    ({"prompt": QUESTION, "chosen": RIGHT}, "bad_structure"),
    ({"chosen": "Human: hi", "rejected": "Human: ho"}, "bad_structure"),
])
def test_bad_pairs_are_refused_by_name(tok, record, reason):
    with pytest.raises(BadRecord) as e:
        label_pair(tok, to_pair(record), 96, truncation_mode="error")
    assert e.value.reason == reason and not isinstance(e.value, SkippedPair)


LONG_ANSWER = {"prompt": QUESTION, "chosen": RIGHT + " Indeed" * 60, "rejected": WRONG}
LONG_PROMPT = {"prompt": QUESTION * 20, "chosen": RIGHT, "rejected": WRONG}


def test_an_over_long_pair_is_cut_at_its_end_or_start_as_trl_does(tok):
    """keep_start keeps each sequence's first data.max_seq_len tokens (the prompt and the answer's start), keep_end
    its last ones (the answer's end, the prompt's start cut), each sequence on its own, the labels cut alike: TRL's
    truncation_mode."""
    whole = label_pair(tok, to_pair(LONG_ANSWER), 10_000)
    for mode, cut in (("keep_start", slice(None, 96)), ("keep_end", slice(-96, None))):
        chosen, rejected = label_pair(tok, to_pair(LONG_ANSWER), 96, truncation_mode=mode)
        assert (chosen.input_ids, chosen.labels) == (whole[0].input_ids[cut], whole[0].labels[cut]), mode
        assert rejected == whole[1]  # short enough: untouched
        assert len(whole[0].input_ids) > 96 and sum(t != IGNORE_INDEX for t in chosen.labels[1:]) > 0
    start, end = (label_pair(tok, to_pair(LONG_ANSWER), 96, truncation_mode=m)[0] for m in ("keep_start", "keep_end"))
    assert tok.decode(start.input_ids).startswith(f"<|user|>\n{QUESTION}")
    assert tok.decode([t for t in end.labels if t != IGNORE_INDEX]).endswith("Indeed Indeed<|end|>")
    # a prompt longer than data.max_seq_len: keep_end keeps the answers and the prompt's end
    chosen, rejected = label_pair(tok, to_pair(LONG_PROMPT), 96, truncation_mode="keep_end")
    assert answer_text(tok, chosen) == RIGHT + "<|end|>" and answer_text(tok, rejected) == WRONG + "<|end|>"
    assert len(chosen.input_ids) == len(rejected.input_ids) == 96


@pytest.mark.parametrize(("mode", "record", "reason"), [
    ("skip", LONG_ANSWER, "answer_truncated"), ("skip", LONG_PROMPT, "prompt_too_long"),
    ("keep_start", LONG_PROMPT, "prompt_too_long")])
def test_over_long_pairs_dropped_by_the_truncation_mode_are_skipped_pairs(tok, mode, record, reason):
    with pytest.raises(SkippedPair) as e:
        label_pair(tok, to_pair(record), 96, truncation_mode=mode)
    assert e.value.reason == reason


def test_a_store_of_over_long_ultrafeedback_pairs_counts_what_each_truncation_mode_did(tmp_path, tok):
    """UltraFeedback's format (a prompt string beside whole conversations), one pair with a long answer and one
    with a long prompt among good ones: under the default data.on_bad_record error, prepare refuses them only
    with dpo.truncation_mode error, naming the file, record and mode; skip and keep_start drop and count what
    cannot be kept, whatever on_bad_record says; each mode is a store of its own."""
    def ultrafeedback(r):
        return {"prompt": r["prompt"], "chosen": [{"role": "user", "content": r["prompt"]},
                                                   {"role": "assistant", "content": r["chosen"]}],
                "rejected": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["rejected"]}]}

    path = tmp_path / "ultrafeedback.jsonl"
    records = [FORMATS["trl plain text"], LONG_ANSWER, LONG_PROMPT, FORMATS["trl plain text"]]
    path.write_text("".join(json.dumps(ultrafeedback(r)) + "\n" for r in records))
    cfg = DataConfig(paths=[str(path)], max_seq_len=96)
    with pytest.raises(DataError, match=r"ultrafeedback.jsonl: record 1: the chosen sequence has \d+ tokens, more "
                                        r"than data.max_seq_len=96: its answer would be cut \(dpo.truncation_mode"):
        prepare_store(cfg, tok, tmp_path / "stores", objective="dpo", truncation_mode="error")
    stores = {}
    for mode in ("skip", "keep_start", "keep_end"):
        stores[mode] = prepare_store(cfg, tok, tmp_path / "stores", objective="dpo", truncation_mode=mode).path
        assert read_store_manifest(stores[mode])["key"]["truncation_mode"] == mode
    counts = {mode: read_store_manifest(store)["counts"] for mode, store in stores.items()}
    assert counts["skip"]["pairs"] == 2 and counts["skip"]["skipped"] == {"answer_truncated": 1,
                                                                          "prompt_too_long": 1}
    assert counts["keep_start"]["pairs"] == 3 and counts["keep_start"]["skipped"] == {"prompt_too_long": 1}
    assert counts["keep_start"]["truncated"] == 1  # the long answer's chosen sequence
    assert counts["keep_end"]["pairs"] == 4 and counts["keep_end"]["truncated"] == 3
    assert [r["record"] for r in read_store(stores["keep_start"], ["record"]).to_pylist()] == [0, 0, 1, 1, 3, 3]


def test_a_prompt_the_template_renders_differently_per_answer_is_refused(tok):
    """A template that shows the answer's length in the header (it inspects the answer): the prompts differ."""
    import copy

    odd = copy.copy(tok)
    odd.chat_template = tok.chat_template.replace("{{ '<|assistant|>\\n' }}{% generation %}",
                                                  "{{ '<|assistant|>' ~ (m['content'] | length) ~ '\\n' }}"
                                                  "{% generation %}")
    assert odd.chat_template != tok.chat_template
    with pytest.raises(BadRecord) as e:
        label_pair(odd, to_pair({"prompt": QUESTION, "chosen": RIGHT, "rejected": WRONG + "!!"}), 512)
    assert e.value.reason == "prompt_mismatch"


def test_the_store_holds_pairs_counts_skips_and_never_mixes_with_sft(tmp_path, tok):
    records = [FORMATS["trl plain text"], {"prompt": QUESTION, "chosen": RIGHT, "rejected": RIGHT},
               FORMATS["hh-rlhf text"]]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = DataConfig(paths=[str(path)], max_seq_len=96)
    with pytest.raises(DataError, match=r"pairs.jsonl: record 1: the chosen and the rejected answer are the same"):
        prepare_store(cfg, tok, tmp_path / "stores", objective="dpo")
    cfg.on_bad_record = "skip"
    store = prepare_store(cfg, tok, tmp_path / "stores", objective="dpo").path
    table = read_store(store).to_pylist()
    assert [(r["record"], r["chosen"]) for r in table] == [(0, True), (0, False), (2, True), (2, False)]
    counts = read_store_manifest(store)["counts"]
    assert counts["pairs"] == 2 and counts["skipped"] == {"identical_answers": 1}
    # the objective is part of the fingerprint: the same files read as SFT conversations are another store (and
    # these records are no conversations)
    assert read_store_manifest(store)["key"]["objective"] == "dpo"
    with pytest.raises(DataError, match="skipped with data.on_bad_record=skip: 3 bad_structure"):
        prepare_store(DataConfig(paths=[str(path)], max_seq_len=96, on_bad_record="skip"), tok, tmp_path / "stores")


def test_packed_pairs_are_separate_samples_and_their_log_probs_are_the_padded_ones(tmp_path, tok):
    from transformers import LlamaConfig, LlamaForCausalLM

    store = prepare_store(DataConfig(paths=["builtin:demo-preferences"], max_seq_len=96), tok, tmp_path,
                          objective="dpo").path
    dataset = TokenizedDataset(store)
    rows = pair_rows([3, 0])
    assert rows.tolist() == [6, 7, 0, 1]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, vocab_size=len(tok))).eval()

    def logps(batch):
        inputs = sequence_loss_inputs(batch.pop("labels"), batch.get("cu_seq_lens_q"))
        logits = model(**batch, use_cache=False).logits.flatten(0, 1).index_select(0, inputs["loss_positions"])
        nll = torch.nn.functional.cross_entropy(logits, inputs["loss_targets"], reduction="none")
        return -torch.zeros(len(rows)).index_add(0, inputs["loss_sequence"], nll)

    packed = collate(dataset, rows, tok.pad_token_id, packing=True)
    assert packed["cu_seq_lens_q"].numel() == len(rows) + 1  # each answer its own sample of the row
    padded = logps(collate(dataset, rows, tok.pad_token_id))
    assert torch.allclose(logps(packed), padded, atol=1e-5)
    assert (padded < 0).all()


def test_pair_losses_are_dpo_and_ipo():
    from raysft.config import DpoConfig

    c, r, rc, rr = (torch.tensor([v]) for v in (-3.0, -5.0, -4.0, -4.5))
    n = torch.tensor([2.0])
    dpo = pair_losses(c, r, rc, rr, n, n * 2, DpoConfig(beta=0.5))
    assert dpo.item() == pytest.approx(-torch.nn.functional.logsigmoid(torch.tensor(0.5 * (1.0 + 0.5))).item())
    ipo = pair_losses(c, r, rc, rr, n, n * 2, DpoConfig(beta=0.5, loss="ipo"))
    assert ipo.item() == pytest.approx((1.0 / 2 - (-0.5) / 4 - 1.0) ** 2)


def dpo_config(tmp_path, name, **sets):
    return tiny_config(tmp_path, **{"train.objective": "dpo", "data.paths": "[builtin:demo-preferences]",
                                    "train.max_steps": 6, "train.global_batch_size": 8, "train.micro_batch_size": 2,
                                    "train.lr": 1e-3, "checkpoint.every_n_steps": 3, "checkpoint.mode": "full",
                                    "train.log_every_n_steps": 100, "run.name": name, **sets})


def with_dropout(tmp_path, tok) -> dict:
    """demo-tiny's architecture as a model.config file, with attention dropout (a float of the attention modules,
    no nn.Dropout)."""
    from transformers import LlamaConfig

    from raysft.model.build import preset_config

    path = tmp_path / "dropout-config.json"
    if not path.exists():
        LlamaConfig(**{**preset_config("demo-tiny", tok).to_dict(), "attention_dropout": 0.3}).to_json_file(path)
    return {"model.config": str(path)}


@pytest.mark.slow  # trains for tens of seconds on 2 cores: make test-fast leaves it out
def test_a_dpo_run_stopped_and_resumed_equals_the_uninterrupted_one_bit_for_bit(tmp_path, gloo_pool, tok):
    """Also with attention dropout in the model's config: dpo.disable_dropout (the default) turns it off, so the
    policy's step 1 is the reference (margin 0) and the resumed run draws nothing the uninterrupted one did not."""
    whole = dpo_config(tmp_path, "whole", **with_dropout(tmp_path, tok))
    gloo_pool.run(launch, whole)
    for stop in (3, 0):
        gloo_pool.run(launch, dpo_config(tmp_path, "resumed", **with_dropout(tmp_path, tok),
                                         **{"train.stop_at_step": stop}))
        if stop:  # a resume that finds no reference file computes it again from the starting weights
            [reference] = whole.store_dir.glob("*/reference/*.safetensors")
            reference.unlink()
    resumed = dpo_config(tmp_path, "resumed", **with_dropout(tmp_path, tok))
    rows = {run: [m for m in read_metrics(cfg.run_dir) if "loss" in m] for run, cfg in (("w", whole), ("r", resumed))}
    keys = ["step", "loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen"]
    assert [[m[k] for k in keys] for m in rows["w"]] == [[m[k] for k in keys] for m in rows["r"]]
    events = [m for m in read_metrics(resumed.run_dir) if m.get("event") == "reference_logps"]
    # the first run on this store and model made the file, the first leg reused it, the second made it again
    assert [e.get("reused", False) for e in events] == [True, False]
    a, b = final_weights(whole.run_dir, tmp_path / "a"), final_weights(resumed.run_dir, tmp_path / "b")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert rows["w"][0]["rewards/margins"] == 0.0 != rows["w"][-1]["rewards/margins"]  # the reference's step 1


@pytest.mark.parametrize("disable_dropout", [True, False], ids=["dropout_off", "dropout_kept"])
def test_lora_dpo_takes_the_base_with_adapters_off_as_its_reference(tmp_path, gloo_pool, tok, disable_dropout):
    """With lora_dropout and the model's attention dropout: dpo.disable_dropout (the default) turns both off, so the
    adapted model (B = 0) is its base at step 1 and every reward is exactly 0; kept, they make the rewards noise."""
    pytest.importorskip("peft")
    cfg = dpo_config(tmp_path, "lora", **with_dropout(tmp_path, tok), **{
        "model.lora.r": 4, "model.lora.dropout": 0.5, "dpo.disable_dropout": disable_dropout,
        "train.max_steps": 3 if disable_dropout else 1, "train.lr": 1e-2})
    gloo_pool.run(launch, cfg)
    records = read_metrics(cfg.run_dir)
    steps = [m for m in records if "loss" in m]
    if not disable_dropout:
        assert steps[0]["rewards/chosen"] != 0.0 and steps[0]["rewards/rejected"] != 0.0
        return
    assert not [m for m in records if m.get("event") == "reference_logps"]  # no pass, no file
    assert not list(cfg.store_dir.glob("*/reference/*"))
    # B = 0 at the start: the adapted model is its base, so step 1's rewards are exactly 0
    assert steps[0]["rewards/chosen"] == steps[0]["rewards/rejected"] == 0.0 and steps[0]["loss"] == \
        pytest.approx(0.693147, abs=1e-6)
    assert steps[-1]["rewards/margins"] != 0.0


def test_disable_dropout_turns_off_dropout_layers_and_attention_dropout_but_keeps_the_config():
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from raysft.model.preference_loss import disable_dropout

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
                                         attention_dropout=0.5))
    model = inject_adapter_in_model(LoraConfig(r=4, lora_dropout=0.5, target_modules=["q_proj", "v_proj"]), model)
    for name, param in model.named_parameters():  # B != 0, so that the adapters' input dropout shows
        if "lora_B" in name:
            torch.nn.init.normal_(param)
    ids = torch.randint(0, 64, (2, 12))
    model.train()
    assert not torch.equal(model(ids).logits, model(ids).logits)
    disable_dropout(model)
    assert torch.equal(model(ids).logits, model(ids).logits)
    model.eval()
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, model.train()(ids).logits, atol=1e-6)  # train is eval now
    assert model.config.attention_dropout == 0.5


def _save_model(path, tok, seed: int, **config):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=1, vocab_size=len(tok), **config)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _copy_keeping_times(source, target) -> None:
    """`cp -p` of source's files over target's, then target's old times put back: names, sizes and mtimes are
    what they were (rsync -a of a model of the same shapes onto files of the same times)."""
    import os
    import shutil

    for file in source.iterdir():
        before = (target / file.name).stat()
        shutil.copy2(file, target / file.name)
        os.utime(target / file.name, ns=(before.st_atime_ns, before.st_mtime_ns))


def test_the_reference_is_keyed_on_content_and_a_relaunch_on_other_weights_is_refused(tmp_path, tok):
    """The reference file's key is the weights' fingerprint (raysft.hf.fingerprint), not names, sizes and mtimes:
    other weights of the same shapes put in place with the old times get a new pass, the same weights copied
    elsewhere the same file. A from-scratch model.config is keyed on its file's content. A DPO run relaunched on
    the other weights is refused naming them (the run's identity pins model.path's weights for every objective)."""
    import shutil

    from raysft.config import ConfigError
    from raysft.launch.prelaunch import claim_run_dir
    from raysft.training.reference import reference_file

    base, other = _save_model(tmp_path / "base", tok, 0), _save_model(tmp_path / "other", tok, 1)
    store = tmp_path / "store"

    def key(path):
        return reference_file(store, dpo_config(tmp_path, "swap", **{"model.path": path, "model.tokenizer": path}))

    cfg = dpo_config(tmp_path, "swap", **{"model.path": base, "model.tokenizer": base})
    claim_run_dir(cfg, "data")
    first = key(base)
    shutil.copytree(base, tmp_path / "copy")
    assert key(tmp_path / "copy") == first  # the same weights elsewhere, with new mtimes: the same reference
    _copy_keeping_times(other, base)
    assert key(base) != first
    with pytest.raises(ConfigError, match=f"the weights at model.path {base} are not those it started from: "
                                          "model.safetensors differs"):
        claim_run_dir(cfg, "data")

    config = tmp_path / "arch" / "config.json"
    _save_model(config.parent, tok, 0, rope_theta=10000.0)
    (tmp_path / "rope").mkdir()
    _save_model(tmp_path / "rope", tok, 0, rope_theta=20000.0)  # the same file's size, another architecture
    before = reference_file(store, dpo_config(tmp_path, "scratch", **{"model.config": config}))
    _copy_keeping_times(tmp_path / "rope", config.parent)
    assert reference_file(store, dpo_config(tmp_path, "scratch", **{"model.config": config})) != before


def test_a_validated_dpo_run_reports_held_out_rewards_keeps_its_best_by_them_and_is_generation_evaluated(
        tmp_path, gloo_pool):
    """Validation pairs that are the training pairs (a copy) and a global batch of all of them: the eval after step
    s sees the weights and pairs that step s + 1 trains on, so its loss and rewards are that step's (to rounding:
    other micro-batches, other padding), with a reference of their own computed by the same pass. checkpoint.keep_best
    ranks by eval/rewards/accuracies (here its lowest, best_mode min, so that the checkpoint it keeps is not the
    newest), and the generation evaluation runs on the DPO run's checkpoints too."""
    from raysft.data.demo import make_demo_preferences

    pairs = make_demo_preferences()[:16]  # the same pairs in other files' bytes: two stores, two references
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    (tmp_path / "heldout.json").write_text(json.dumps(pairs))
    (tmp_path / "gen.jsonl").write_text('{"prompt": "What is 2 plus 3?", "answer": "2 plus 3 is 5."}\n')
    cfg = dpo_config(tmp_path, "validated", **{
        "data.paths": f"[{tmp_path / 'train.jsonl'}]", "data.eval_paths": f"[{tmp_path / 'heldout.json'}]",
        "train.global_batch_size": 16, "train.max_steps": 3, "train.eval_every_n_steps": 1, "train.lr": 1e-2,
        "checkpoint.every_n_steps": 1, "checkpoint.keep_best": 1, "checkpoint.best_metric": "eval/rewards/accuracies",
        "checkpoint.best_mode": "min",  # the worst ranker kept: not the newest, so ranking is what keeps it
        "eval.path": str(tmp_path / "gen.jsonl"), "eval.max_new_tokens": 8})
    gloo_pool.run(launch, cfg)
    records = read_metrics(cfg.run_dir)
    steps = {m["step"]: m for m in records if "loss" in m}
    assert sorted(steps) == [1, 2, 3] and all(steps[s]["eval_pairs"] == 16 for s in steps)
    for s in (1, 2):
        evaluated, trained = steps[s], steps[s + 1]
        assert evaluated["eval/rewards/accuracies"] == trained["rewards/accuracies"]
        for name in ("rewards/margins", "rewards/chosen", "rewards/rejected"):
            assert evaluated[f"eval/{name}"] == pytest.approx(trained[name], rel=1e-4, abs=1e-6), name
        assert evaluated["eval_loss"] == pytest.approx(trained["loss"], rel=1e-5)
    assert steps[2]["eval/rewards/margins"] != 0.0
    passes = [m for m in records if m.get("event") == "reference_logps"]
    assert len(passes) == 2 and passes[0]["file"] != passes[1]["file"]  # the training store's, the eval store's
    accuracy = {s: steps[s]["eval/rewards/accuracies"] for s in steps}
    best = min(accuracy, key=lambda s: (accuracy[s], -s))  # of equal ones, the newer
    kept = sorted(int(p.name.split("_")[1]) for p in cfg.run_dir.glob("checkpoint_*"))
    assert best != 3 and kept == [best, 3], accuracy
    state = json.loads((cfg.run_dir / f"checkpoint_{best:08d}" / "trainer_state.json").read_text())
    assert state["eval_metrics"]["eval/rewards/accuracies"] == accuracy[best]
    generated = [m for m in records if m.get("event") == "gen_eval"]
    assert [e["step"] for e in generated] == [1, 2, 3] and all("gen/exact_match" in e for e in generated)
