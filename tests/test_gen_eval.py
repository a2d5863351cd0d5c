"""Generation evaluation without Ray: the scorers on edge cases, the eval set and its refusals, the config's checks,
the Hugging Face engine against `raysft chat`, the torchrun launch's in-process evaluation of every checkpoint (a
sharded LoRA run), `raysft eval` on that checkpoint and on its export, a timed-out evaluation that leaves training
running, retention by a generation score, and the log of the records. Under Ray: tests/test_train_ray.py."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import cli_in_process, tiny_config

from raysft.checkpoint import STATE_FILE
from raysft.checkpoint.gen_record import read_failure, read_result, recorded_metric, write_failure, write_result
from raysft.checkpoint.manifest import durable_file_list, write_manifest
from raysft.checkpoint.retention import select_checkpoint, to_prune
from raysft.config import ConfigError, GenEvalConfig, ModelConfig, best_mode
from raysft.data.demo import DEMO_CONVERSATIONS, HELD_OUT
from raysft.data.tokenizer import load_tokenizer
from raysft.errors import DataError
from raysft.evals.engines import EvalTimeout, HfEngine, cut_at_stop, length_sorted_batches
from raysft.evals.evalset import check_renders, read_eval_set
from raysft.evals.scorers import check_expected, score
from raysft.launch.torchrun import launch
from raysft.products.chat_model import ChatModel
from raysft.products.export import export
from raysft.storage import location
from raysft.tools.report import read_curves
from raysft.training.gen_log import GenEvalLog, score_line
from raysft.training.metrics import MetricsLogger, read_metrics


@pytest.mark.parametrize(("scorer", "generation", "expected", "value"), [
    ("exact_match", "The capital of France is Paris.", "the capital of france is paris", 1.0),
    ("exact_match", "Paris", "The capital of France is Paris.", 0.0),
    ("exact_match", "A cat!", "cat", 1.0),  # SQuAD's normalization: articles and punctuation go
    ("exact_match", "Ｐａｒｉｓ", "Paris", 1.0),  # NFKC: full-width letters are the plain ones
    ("exact_match", "1,234", "1234", 1.0),
    ("contains", "I think it is 4.", "4", 1.0),
    ("contains", "14 apples", "4", 0.0),  # whole words only
    ("contains", "", "4", 0.0),
    ("choice", "B", "B", 1.0),
    ("choice", "(C) because it is", "C", 1.0),
    ("choice", "The answer is D.", "d", 1.0),
    ("choice", "B) seven", "(B)", 1.0),
    ("choice", "A cat sat on the mat", "A", 0.0),  # an article opening the text is no answer
    ("choice", "The answer is a cat", "A", 0.0),
    ("number", "#### 1,234", "1234", 1.0),
    ("number", "3 + 4 = 7 apples\n#### 7", "48 / 2 = 24 clips ... #### 72", 0.0),  # GSM8K: after ####
    ("number", "The answer is 42.0, not 41", "42", 1.0),  # after "answer is", the first number
    ("number", "She pays $5.", "5", 1.0),
    ("number", "5-3=2", "2", 1.0),  # the last number; "-3" here is no negative number
    ("number", "It is -3 degrees", "-3", 1.0),
    ("number", "version x2", "2", 0.0),  # glued to a word: no number
    ("number", "no number here", "7", 0.0),
    # what models write: the choice read however it is put, the final number, the decimal point kept
    ("choice", "The answer is: B", "B", 1.0),
    ("choice", "**B**", "B", 1.0),
    ("choice", "B, because the sky scatters blue", "B", 1.0),
    ("choice", "b", "B", 1.0),
    ("choice", "Option B", "B", 1.0),
    ("choice", "Answer: (c)", "C", 1.0),
    ("number", "The answer is 3 + 4, so 7", "7", 1.0),  # "answer is" opens a sum: the last number after it
    ("number", "We have 3 and 4 more, so 7", "7", 1.0),
    ("number", "It is \u22123 degrees", "-3", 1.0),  # a Unicode minus
    ("number", "1,2,3", "123", 0.0),  # three numbers, not 123
    ("number", "1,2,3", "3", 1.0),
    ("number", "$1,000,000", "1000000", 1.0),
    ("exact_match", "3.5", "35", 0.0),  # the decimal point stays
    ("exact_match", "3.5.", "3.5", 1.0),
])
def test_scorers_on_edge_cases(scorer, generation, expected, value):
    assert score(generation, expected, [scorer]) == {scorer: value}


def test_choice_counts_only_the_letters_the_prompt_offers():
    """With options on lines of their own, a letter the prompt does not offer is no answer, and a capital standing
    alone is one (but not the article "A" or the pronoun "I" before a word)."""
    from raysft.evals.scorers import offered_letters

    prompt = "Which is blue?\nA. grass\nB. the sky\nC. snow\nD. coal"
    assert offered_letters(prompt) == frozenset("ABCD") and offered_letters("What is 2 + 2?") is None
    assert score("It is E, I mean C", "C", ["choice"], prompt=prompt) == {"choice": 1.0}
    assert score("I think B is right", "B", ["choice"], prompt=prompt) == {"choice": 1.0}
    assert score("A cat would say C", "C", ["choice"], prompt=prompt) == {"choice": 1.0}
    assert score("The answer is a cat", "A", ["choice"], prompt=prompt) == {"choice": 0.0}


def test_each_score_carries_its_standard_error_and_each_sample_its_length_and_whether_the_limit_cut_it():
    from raysft.evals.engines import Answer
    from raysft.evals.runner import summary
    from raysft.evals.scorers import standard_error

    assert standard_error([1.0, 0.0, 1.0, 0.0]) == pytest.approx((1 / 3 / 4) ** 0.5)  # sample sd / sqrt(n)
    assert standard_error([1.0]) == standard_error([]) == 0.0
    record = {"metrics": {"gen/exact_match": 0.5}, "stderr": {"gen/exact_match": 0.289}, "cut": 1, "samples": 4,
              "engine": "hf", "seconds": 2.0}
    assert summary(record) == "gen/exact_match 0.500 ± 0.289 (4 samples, 1 cut at eval.max_new_tokens, hf, 2.0 s)"
    assert Answer("x", 3, False).tokens == 3


def test_regex_compares_the_patterns_group_or_whole_match_with_the_expected_answer():
    import re

    grouped, whole = re.compile(r"answer: (\w+)"), re.compile(r"\d+")
    assert score("The answer: Paris!", "paris", ["regex"], grouped) == {"regex": 1.0}
    assert score("The answer: Rome!", "paris", ["regex"], grouped) == {"regex": 0.0}
    assert score("no colon here Paris", "paris", ["regex"], grouped) == {"regex": 0.0}  # no match
    assert score("it is 12 or 13", "12", ["regex"], whole) == {"regex": 1.0}  # the first match
    either = re.compile(r"answer: (\w+)|final: (\w+)")  # an alternation: the group that took part in the match
    assert score("final: Paris", "paris", ["regex"], either) == {"regex": 1.0}


@pytest.mark.parametrize(("expected", "scorers", "fragment"), [
    ("Paris", ["number"], "has no number"),
    ("seven", ["choice"], "names no choice letter"),
    ("the", ["exact_match"], "empty after normalization"),
])
def test_an_expected_answer_no_scorer_could_match_is_named(expected, scorers, fragment):
    assert fragment in check_expected(expected, scorers)
    assert check_expected("The answer is B, 4", ["number", "choice", "contains"]) is None


def write_lines(path: Path, *records) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def test_the_eval_set_reads_every_format_with_its_expected_answer(tmp_path):
    name = write_lines(tmp_path / "eval.jsonl",
                       {"prompt": "What is 2 plus 3?", "answer": 5, "id": 7},
                       "",  # a blank line is no record
                       {"messages": [{"role": "user", "content": "Capital of Peru?"}], "expected": "Lima"},
                       {"conversations": [{"from": "human", "value": "Opposite of hot?"},
                                          {"from": "gpt", "value": "Cold."}]})
    samples = read_eval_set(name, ["exact_match"], system_prompt="Be brief.")
    assert [(s.where, s.expected, s.id) for s in samples] == [("line 1", "5", "7"), ("line 3", "Lima", None),
                                                              ("line 4", "Cold.", None)]
    assert samples[2].messages == [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "Opposite of hot?"}]  # the answer is not prompted
    assert [s.prompt for s in samples] == ["What is 2 plus 3?", "Capital of Peru?", "Opposite of hot?"]
    assert len(read_eval_set(name, ["exact_match"], limit=2)) == 2


@pytest.mark.parametrize(("record", "fragment"), [
    ("{not json", "line 2: not valid JSON"),
    ({"prompt": "hi"}, "line 2: has no 'answer' and its conversation does not end with the assistant's answer"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], "answer": "x"},
     "line 2: the prompt ends on an assistant turn"),
    ({"prompt": "hi", "answer": True}, "line 2: 'answer' must be text or a number, got True"),
    ({"messages": [{"role": "wizard", "content": "hi"}], "answer": "x"}, "line 2: messages[0].role is 'wizard'"),
    ({"prompt": "Capital of Peru?", "answer": "Lima"}, "line 2: the expected answer 'Lima' has no number"),
    ({"prompt": "", "answer": "4"}, "line 2: 'prompt' must be non-empty text"),
])
def test_a_bad_eval_record_is_refused_naming_file_and_line(tmp_path, record, fragment):
    name = write_lines(tmp_path / "eval.jsonl", {"prompt": "What is 2 plus 2?", "answer": "4"}, record)
    with pytest.raises(DataError) as error:
        read_eval_set(name, ["number"])
    assert str(error.value).startswith(f"{tmp_path / 'eval.jsonl'}: line 2: ") and fragment in str(error.value)


def test_a_json_array_eval_set_names_the_record_and_an_empty_one_is_refused(tmp_path):
    (tmp_path / "eval.json").write_text(json.dumps([{"prompt": "a?", "answer": "b"}, {"prompt": "c?"}]))
    with pytest.raises(DataError, match=r"eval.json: record 1: has no 'answer'"):
        read_eval_set(str(tmp_path / "eval.json"), ["exact_match"])
    with pytest.raises(DataError, match="no eval records"):
        read_eval_set(write_lines(tmp_path / "empty.jsonl"), ["exact_match"])


def test_the_demo_eval_set_holds_out_one_question_and_its_others_are_in_the_training_data():
    samples = read_eval_set("builtin:demo-eval", ["exact_match", "contains"])
    asked = {turn["value"] for record in json.loads(DEMO_CONVERSATIONS.read_text())
             for turn in record["conversations"] if turn["from"] == "human"}
    assert len(samples) == 40 and [s.prompt for s in samples if s.prompt not in asked] == list(HELD_OUT)


def test_a_prompt_the_chat_template_cannot_render_is_refused_naming_its_line(tmp_path):
    tok = load_tokenizer(ModelConfig(), "auto")
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system "
                         "turns') }}{% endif %}{{ m['content'] }}{% endfor %}")
    name = write_lines(tmp_path / "eval.jsonl", {"prompt": "a?", "answer": "b"},
                       {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}],
                        "answer": "b"})
    with pytest.raises(DataError, match=r"eval.jsonl: line 2: the chat template cannot render this prompt: .*no "
                                        r"system turns"):
        check_renders(read_eval_set(name, ["exact_match"]), tok, name)


@pytest.mark.parametrize(("sets", "fragment"), [
    ({"eval.scorers": "[bleu]"}, "config key 'eval.scorers': 'bleu' is not one of exact_match"),
    ({"eval.scorers": "[regex]"}, "config key 'eval.answer_pattern': the regex scorer needs a regular expression"),
    ({"eval.scorers": "[regex]", "eval.answer_pattern": "'(oops'"}, "'(oops' is not a regular expression"),
    ({"eval.engine": "vllm"}, "config key 'eval.engine': vllm runs its engine on GPUs"),
    ({"eval.timeout_s": 0}, "config key 'eval.timeout_s': must be > 0"),
    ({"eval.path": "s3://bucket/eval.jsonl"}, "config key 'eval.path': must be a file every node can read"),
    ({"checkpoint.keep_best": 1, "checkpoint.best_metric": "gen/exact_match"},
     "config key 'checkpoint.keep_best': ranks checkpoints by gen/exact_match, a generation score: set eval.path"),
    ({"checkpoint.keep_best": 1, "checkpoint.best_metric": "gen/number", "eval.path": "e.jsonl"},
     "gen/number ranks by the number scorer, which eval.scorers ['exact_match'] does not run"),
    ({"checkpoint.best_metric": "gen/bleu"}, "a generation score is gen/<scorer>"),
    ({"checkpoint.best_metric": "accuracy"}, "'accuracy' is not a metric of this run's evaluations"),
    ({"checkpoint.best_metric": "eval/rewards/accuracies", "data.eval_fraction": 0.1},  # an SFT run has no rewards
     "'eval/rewards/accuracies' is not a metric"),
])
def test_the_eval_section_and_the_best_metric_are_checked_by_key(tmp_path, sets, fragment):
    with pytest.raises(ConfigError) as error:
        tiny_config(tmp_path, **sets)
    assert fragment in str(error.value)


def test_a_dpo_run_may_be_validated_and_keep_its_best_by_reward_accuracy(tmp_path):
    cfg = tiny_config(tmp_path, **{"train.objective": "dpo", "data.paths": "[builtin:demo-preferences]",
                                   "data.eval_fraction": 0.1, "checkpoint.keep_best": 1,
                                   "checkpoint.best_metric": "eval/rewards/accuracies"})
    assert best_mode(cfg.checkpoint) == "max" and best_mode(tiny_config(tmp_path).checkpoint) == "min"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """demo-tiny with random weights and the demo tokenizer: an HF directory `raysft chat` loads."""
    return saved_tiny_model(load_tokenizer(ModelConfig(), "auto"), tmp_path_factory.mktemp("tiny") / "model")


def saved_tiny_model(tok, out: Path) -> Path:
    """demo-tiny's shapes with seeded random weights and `tok`, saved as an HF directory at out."""
    from transformers import LlamaForCausalLM

    from raysft.model.build import preset_config

    torch.manual_seed(0)
    LlamaForCausalLM(preset_config("demo-tiny", tok)).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_hf_engine_greedy_answers_are_the_answers_of_raysft_chat(tiny_model, monkeypatch):
    samples = read_eval_set("builtin:demo-eval", ["exact_match"])
    engine = HfEngine(tiny_model, GenEvalConfig(path="builtin:demo-eval", max_new_tokens=12, batch_size=8))
    prompts = [engine.prompt_ids(s) for s in samples]
    batches = length_sorted_batches(prompts, 8)
    assert sum(len({len(prompts[i]) for i in b}) > 1 for b in batches) >= 2  # rows of several lengths, left-padded
    generated = engine.generate(samples)
    answers = [a.text for a in generated]
    chat = ChatModel.load(tiny_model)
    assert answers == [chat.reply(s.messages, max_new_tokens=12) for s in samples]
    assert len(set(answers)) > 1 and all(answers)
    # an answer that reached max_new_tokens without its end is marked cut (this untrained model's: all 12 tokens)
    assert all(a.cut and a.tokens == 12 for a in generated)

    # a stop string ends a generation, cut off; sampling draws the same answers from the same seed
    stop = next(a for a in answers[:16] if len(a) >= 6)[3:5]
    generated = HfEngine(tiny_model, GenEvalConfig(path="x", max_new_tokens=12, stop=[stop])).generate(samples[:16])
    stopped = [a.text for a in generated]
    assert stopped == [cut_at_stop(a, [stop]) for a in answers[:16]] != answers[:16]
    assert [a.cut for a in generated] == [s == a for s, a in zip(stopped, answers[:16], strict=True)]  # a stop: no cut
    rng = torch.random.get_rng_state()
    sampled = [[a.text for a in HfEngine(tiny_model, GenEvalConfig(path="x", max_new_tokens=12, temperature=1.0,
                                                                   seed=seed)).generate(samples[:8])]
               for seed in (3, 3, 4)]
    assert sampled[0] == sampled[1] != sampled[2]
    assert torch.equal(torch.random.get_rng_state(), rng)  # the caller's random stream (training's) is untouched
    # the deadline is checked before each batch: one passing while the first batch runs stops the second
    import raysft.evals.engines

    clock = iter([0.0] + [10.0] * len(samples))
    monkeypatch.setattr(raysft.evals.engines, "time", SimpleNamespace(monotonic=lambda: next(clock)))
    with pytest.raises(EvalTimeout, match="after 1 of"):
        engine.generate(samples, deadline=5.0)


EVAL_SETS = {"eval.scorers": "[exact_match, contains]", "eval.max_new_tokens": 8}


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, gloo_pool):
    """A sharded LoRA run under torchrun (4 steps, a checkpoint every 2, and the base at step 0), each checkpoint
    evaluated in-process on 6 demo questions."""
    pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("gen")
    eval_set = write_lines(root / "eval.jsonl", *[json.loads(line) for line in
                                                  (Path(__file__).parent.parent / "raysft/assets/demo/eval.jsonl")
                                                  .read_text().splitlines()[:6]])
    cfg = tiny_config(root, **{"model.lora.r": 4, "checkpoint.mode": "sharded", "train.max_steps": 4,
                               "checkpoint.every_n_steps": 2, "checkpoint.keep": 3, "eval.path": eval_set,
                               "eval.at_start": True,
                               "run.name": "lora", **EVAL_SETS})
    gloo_pool.run(launch, cfg)
    return cfg


def test_torchrun_evaluates_every_checkpoint_in_process_and_logs_each_once(lora_run):
    events = [m for m in read_metrics(lora_run.run_dir) if m.get("event", "").startswith("gen_eval")]
    assert [(e["event"], e["step"]) for e in events] == [("gen_eval", 0), ("gen_eval", 2), ("gen_eval", 4)]
    for e in events:
        ckpt = lora_run.run_dir / e["checkpoint"]
        record = read_result(ckpt)
        assert record["metrics"] == {k: v for k, v in e.items() if k.startswith("gen/")}
        assert set(record["metrics"]) == {"gen/exact_match", "gen/contains"} and record["samples"] == 6
        rows = [json.loads(line) for line in (ckpt / "eval" / "samples.jsonl").read_text().splitlines()]
        assert len(rows) == 6 and set(rows[0]) >= {"prompt", "generation", "expected", "scores"}
        assert e["table"] == str(ckpt / "eval" / "samples.jsonl")
        assert record["metrics"]["gen/contains"] == sum(r["scores"]["contains"] for r in rows) / 6


def test_the_vllm_engine_reads_a_sharded_lora_checkpoint_from_an_export_on_the_runs_storage(lora_run):
    """vLLM's engine runs on whichever GPU node Ray Data places it: a checkpoint that needs an export (sharded,
    LoRA) gets it beside itself on the run's storage, which every node reads, merged and in bf16, for as long as the
    evaluation runs; the hf engine loads it in its own process."""
    from safetensors import safe_open

    from raysft.evals.runner import VLLM_EXPORT, model_directory

    ckpt = lora_run.run_dir / "checkpoint_00000004"
    with model_directory(ckpt, "vllm") as model_dir:
        assert Path(model_dir) == ckpt / "eval" / VLLM_EXPORT
        assert (Path(model_dir) / "config.json").is_file() and not (Path(model_dir) / "adapter_config.json").exists()
        with safe_open(Path(model_dir) / "model.safetensors", "pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert not (ckpt / "eval" / VLLM_EXPORT).exists()
    with model_directory(ckpt, "hf") as model_dir:
        assert Path(model_dir) == ckpt  # the hf engine loads it as `raysft chat` does, in this process


def test_raysft_eval_on_the_sharded_lora_checkpoint_and_on_its_export(lora_run, tmp_path, monkeypatch):
    ckpt = lora_run.run_dir / "checkpoint_00000004"
    out = cli_in_process("eval", str(ckpt), lora_run.eval.path)  # no --config: the run's own settings, its record
    assert out.returncode == 0, out.stderr
    assert "the run's own settings" in out.stdout and "was evaluated so before (same eval set" in out.stdout
    args = [lora_run.eval.path, "--scorers", "exact_match,contains", "--max-new-tokens", "8"]
    out = cli_in_process("eval", str(ckpt), *args)
    assert out.returncode == 0, out.stderr
    assert "was evaluated so before (same eval set and settings)" in out.stdout  # the run's record, not redone
    assert f"raysft: per-sample table {ckpt}/eval/samples.jsonl" in out.stdout
    recorded = ckpt / "eval" / "samples.jsonl"
    generations = [json.loads(line)["generation"] for line in recorded.read_text().splitlines()]

    (ckpt / "eval" / "result.json").unlink()  # evaluated again, from the sharded files: the same answers
    out = cli_in_process("eval", str(lora_run.run_dir), *args, "--checkpoint", "4")
    assert out.returncode == 0 and "gen/exact_match" in out.stdout, out.stderr
    assert [json.loads(line)["generation"] for line in recorded.read_text().splitlines()] == generations

    monkeypatch.chdir(tmp_path)  # other settings: the run's record stays, this evaluation goes to ./eval-<name>
    out = cli_in_process("eval", str(ckpt), *args[:-1], "4")
    assert out.returncode == 0, out.stderr
    assert f"holds the record of another evaluation (eval set or settings): this one goes to {tmp_path}" in out.stdout
    assert (tmp_path / "eval-checkpoint_00000004" / "samples.jsonl").is_file()
    assert read_result(ckpt)["key"]["max_new_tokens"] == 8

    merged = export(ckpt, tmp_path / "merged", merge=True)  # the model the LoRA checkpoint holds, exported
    out = cli_in_process("eval", str(merged), *args, "--out", str(tmp_path / "out"))
    assert out.returncode == 0, out.stderr
    assert f"raysft: per-sample table {tmp_path / 'out' / 'samples.jsonl'}" in out.stdout
    table = (tmp_path / "out" / "samples.jsonl").read_text().splitlines()
    assert [json.loads(line)["generation"] for line in table] == generations
    assert json.loads((tmp_path / "out" / "result.json").read_text())["model"] == str(merged)
    # a flag is a string as typed, never YAML (where this pattern is a mapping)
    out = cli_in_process("eval", str(merged), lora_run.eval.path, "--scorers", "regex", "--answer-pattern",
                         r"answer: (\w+)", "--max-new-tokens", "4", "--out", str(tmp_path / "regex"))
    assert out.returncode == 0, out.stderr
    assert json.loads((tmp_path / "regex" / "result.json").read_text())["key"]["answer_pattern"] == r"answer: (\w+)"


def test_an_evaluation_that_times_out_is_one_event_and_training_goes_on(tmp_path, gloo_pool):
    cfg = tiny_config(tmp_path, **{"train.max_steps": 4, "checkpoint.every_n_steps": 2,
                                   "eval.path": "builtin:demo-eval", "eval.timeout_s": 0.001, **EVAL_SETS})
    gloo_pool.run(launch, cfg)
    records = read_metrics(cfg.run_dir)
    assert [m["step"] for m in records if "loss" in m] == [1, 2, 3, 4]  # training went on after the first
    failed = [m for m in records if m.get("event", "").startswith("gen_eval")]
    assert [(e["event"], e["step"], e["outcome"]) for e in failed] == [("gen_eval_failed", 2, "timed_out"),
                                                                    ("gen_eval_failed", 4, "timed_out")]
    assert "EvalTimeout: eval.timeout_s=0.001 passed after 0 of" in failed[0]["reason"]
    assert read_result(cfg.run_dir / "checkpoint_00000004") is None
    assert recorded_metric(cfg.run_dir / "checkpoint_00000004", "gen/contains") is None  # unranked


def fake_checkpoint(run_dir: Path, step: int, score: float | None = None, failed: bool = False) -> Path:
    """A complete checkpoint of `step`, as a commit leaves it, with a generation evaluation's record."""
    ckpt = run_dir / f"checkpoint_{step:08d}"
    ckpt.mkdir(parents=True)
    (run_dir / "raysft_run.json").write_text("{}")  # a run's checkpoint: its records are copied to gen_evals/
    (ckpt / STATE_FILE).write_text(json.dumps({"step": step}))
    write_manifest(ckpt, step, [durable_file_list(ckpt)])
    common = {"step": step, "key": {}, "finished": 1000.0 + step}
    if score is not None:
        write_result(ckpt, {**common, "metrics": {"gen/exact_match": score}, "samples": 4, "table": "samples.jsonl",
                            "engine": "hf", "started": 999.0, "seconds": 1.0, "cut": 0,
                            "stderr": {"gen/exact_match": 0.25}})
    if failed:
        write_failure(ckpt, {**common, "kind": "failed", "reason": "RuntimeError: no vLLM"})
    return ckpt


def test_keep_best_by_a_generation_score_keeps_the_best_and_the_latest_a_failed_one_ranks_last(tmp_path):
    run = tmp_path / "run"
    ckpts = [fake_checkpoint(run, 2, 0.5), fake_checkpoint(run, 4, 0.9), fake_checkpoint(run, 6, failed=True),
             fake_checkpoint(run, 8, 0.1)]
    maximum, minimum = ("gen/exact_match", "max"), ("gen/exact_match", "min")
    assert [c.name for c in to_prune(ckpts, 1, 1, maximum)] == ["checkpoint_00000002", "checkpoint_00000006"]
    assert [c.name for c in to_prune(ckpts, 1, 2, maximum)] == ["checkpoint_00000006"]
    assert [c.name for c in to_prune(ckpts, 1, 2, minimum)] == ["checkpoint_00000004", "checkpoint_00000006"]
    assert select_checkpoint(run, "best", maximum).name == "checkpoint_00000004"
    assert recorded_metric(ckpts[2], "gen/exact_match") is None and read_failure(ckpts[2])["kind"] == "failed"


def test_a_checkpoint_saved_while_an_evaluation_runs_is_skipped_but_the_base_and_the_last_never_are(tmp_path,
                                                                                                     capsys):
    """eval.every_checkpoint false under Ray: rank 0 asks for a checkpoint's evaluation only when the one asked for
    before has ended (or its request expired), except for the base (step 0) and the run's last; a checkpoint not
    asked for is recorded as skipped, one gen_eval_skipped event, so that at most two wait on disk."""
    from raysft.launch.ray_controller import EVAL_REQUEST_FILE, evaluation_ended, request_evaluation
    from raysft.launch.ray_worker import evaluation_wanted

    cfg = tiny_config(tmp_path, **{"eval.path": "builtin:demo-eval", "train.max_steps": 8})
    ckpts = {s: fake_checkpoint(cfg.run_dir, s) for s in (0, 2, 4, 6, 8)}
    asked = [s for s in (0, 2) if evaluation_wanted(cfg, location(ckpts[s]), s)]
    assert asked == [0]  # the base asked for; step 2 saved while it ran
    evaluation_ended(cfg.run_dir, "checkpoint_00000002")  # not the one asked for: changes nothing
    assert evaluation_wanted(cfg, location(ckpts[4]), 4) is False
    evaluation_ended(cfg.run_dir, "checkpoint_00000000")
    assert evaluation_wanted(cfg, location(ckpts[6]), 6) is True
    assert evaluation_wanted(cfg, location(ckpts[8]), 8) is True  # the last, though step 6's still runs
    evaluation_ended(cfg.run_dir, "checkpoint_00000006")  # the last's request stays until its own end
    assert json.loads((cfg.run_dir / EVAL_REQUEST_FILE).read_text())["checkpoint"] == "checkpoint_00000008"
    assert request_evaluation(cfg.run_dir, "checkpoint_00000009", always=False, expires_s=0) is not None
    (cfg.run_dir / EVAL_REQUEST_FILE).write_text(json.dumps({"checkpoint": "x", "expires": 0}))  # expired
    assert request_evaluation(cfg.run_dir, "checkpoint_00000010", always=False, expires_s=60) is None

    log = MetricsLogger(cfg.run_dir, 8, 1)
    assert GenEvalLog(cfg.run_dir, log).poll(now=True) == 2
    skipped = [m for m in read_metrics(cfg.run_dir) if m.get("event") == "gen_eval_skipped"]
    assert [e["step"] for e in skipped] == [2, 4]
    assert "the evaluation of checkpoint_00000000 had not ended when it was saved" in skipped[0]["reason"]
    assert capsys.readouterr().out.splitlines()[0].startswith(
        "raysft: gen_eval_skipped step 2: not evaluated: the evaluation of checkpoint_00000000 had not ended")
    assert score_line(skipped, "e.jsonl").endswith("; 2 skipped while an earlier one ran (eval.every_checkpoint)")
    every = tiny_config(tmp_path, **{"eval.path": "builtin:demo-eval", "eval.every_checkpoint": True})
    assert evaluation_wanted(every, location(ckpts[4]), 4) is True  # every one asked for, in order


def test_the_log_takes_each_record_once_across_launches_and_report_plots_the_scores(tmp_path, capsys):
    run = tmp_path / "run"
    fake_checkpoint(run, 2, 0.5)
    fake_checkpoint(run, 4, failed=True)
    rows = [{"step": s, "time": 0, "loss": 3 - 0.1 * s, "tokens_per_s": 100.0} for s in range(1, 7)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def follow() -> int:
        log = MetricsLogger(run, 6, 1)
        return GenEvalLog(run, log).poll(now=True)

    assert follow() == 2 and follow() == 0  # a relaunch logs nothing twice
    # the terminal gets one short line per record: step, scores with their standard error, samples, seconds
    assert capsys.readouterr().out.splitlines() == [
        "raysft: gen_eval step 2: exact_match 0.500 ± 0.250 (4 samples, 1.0 s)",
        "raysft: gen_eval_failed step 4: failed: RuntimeError: no vLLM"]
    fake_checkpoint(run, 6, 0.75)
    assert follow() == 1
    events = [m for m in read_metrics(run) if m.get("event", "").startswith("gen_eval")]
    assert [(e["event"], e["step"]) for e in events] == [("gen_eval", 2), ("gen_eval_failed", 4), ("gen_eval", 6)]
    assert events[1]["reason"] == "RuntimeError: no vLLM" and events[2]["gen/exact_match"] == 0.75
    assert score_line(events, "e.jsonl") == ("generation eval (e.jsonl, 4 prompts): step 2: gen/exact_match 0.500 "
                                             "-> step 6: gen/exact_match 0.750; 1 failed (gen_eval_failed in "
                                             "metrics.jsonl)")
    curves = read_curves(run)
    assert curves.gen_scores() == {"gen/exact_match": {2: 0.5, 6: 0.75}}
    assert ", gen/exact_match 0.750 (step 6)," in curves.summary()
    out = cli_in_process("report", str(run))
    assert out.returncode == 0 and (run / "report.png").is_file(), out.stderr


def test_a_bad_eval_set_stops_raysft_train_before_anything_is_written(tmp_path):
    bad = write_lines(tmp_path / "eval.jsonl", {"prompt": "What is 2 plus 2?", "answer": "4"},
                      {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
                       "answer": "x"})
    out = cli_in_process("train", "--set", f"eval.path={bad}", "--set", f"run.storage_path={tmp_path / 'runs'}")
    assert out.returncode == 1, out.stderr
    assert f"DataError: {bad}: line 2: the prompt ends on an assistant turn" in out.stderr
    assert not (tmp_path / "runs").exists()  # no store tokenized, no run claimed


def test_an_in_process_evaluation_leaves_the_training_rng_and_memory_as_it_found_them(lora_run, tmp_path,
                                                                                       monkeypatch):
    """torchrun's rank 0 evaluates in the training process: a sampled evaluation of a sharded LoRA checkpoint
    (exported, merged and loaded for it) draws nothing from the training's random stream, and its model is gone
    once the evaluation returns."""
    import shutil
    import weakref

    import raysft.evals.runner
    from raysft.evals.validation import EvaluatingSink

    run = tmp_path / "run"
    shutil.copytree(lora_run.run_dir / "checkpoint_00000004", run / "checkpoint_00000004")
    cfg = tiny_config(tmp_path, **{"eval.path": lora_run.eval.path, "eval.temperature": 1.0, "eval.seed": 5,
                                   "run.storage_path": str(tmp_path), "run.name": "run", **EVAL_SETS})
    models, opened = [], raysft.evals.runner.open_engine

    def open_engine(*args):
        engine = opened(*args)
        models.append(weakref.ref(engine.chat.model))
        return engine

    monkeypatch.setattr(raysft.evals.runner, "open_engine", open_engine)
    sink = EvaluatingSink(SimpleNamespace(shared=True), cfg, rank=0)
    torch.manual_seed(1234)
    before = torch.random.get_rng_state()
    sink._evaluate(4)
    assert read_result(run / "checkpoint_00000004")["key"]["temperature"] == 1.0  # evaluated now, sampled
    assert torch.equal(torch.random.get_rng_state(), before), "the evaluation drew from the training's RNG"
    assert len(models) == 1 and models[0]() is None, "the evaluated model outlived its evaluation"


def test_a_run_attempts_a_checkpoints_evaluation_at_most_max_attempts_times_across_its_launches(tmp_path,
                                                                                                 monkeypatch):
    """Ray requeues, at each launch, the validation of a checkpoint that the run stopped in: a crash that repeats
    would be met at every launch. Ray's validation function starts one checkpoint's evaluation (of one key) at most
    MAX_ATTEMPTS times; an attempt that ended unrecorded (its process died with its launch) counts too; the give-up
    is recorded once (one gen_eval_failed event, outcome gave_up) and nothing is generated for it; another eval set
    or setting is another evaluation, counted afresh."""
    from dataclasses import asdict

    from pyarrow.fs import LocalFileSystem

    import raysft.evals.runner as runner
    from raysft.evals.validation import validate_checkpoint

    run = tmp_path / "run"
    ckpt = fake_checkpoint(run, 4)
    monkeypatch.setattr(runner, "read_trainer_state", lambda _: {"step": 4})
    outcomes = [RuntimeError("CUDA error: an illegal memory access"), KeyboardInterrupt(),
                RuntimeError("CUDA error: out of memory"), RuntimeError("another key's own failure")]

    def evaluate(*args, **kwargs):
        raise outcomes.pop(0)

    monkeypatch.setattr(runner, "evaluate", evaluate)
    log = GenEvalLog(run, MetricsLogger(run, 8, 1))
    settings = asdict(GenEvalConfig(path="builtin:demo-eval"))

    def validate(raises, match: str | None = None, **sets) -> None:
        with pytest.raises(raises, match=match):
            validate_checkpoint(SimpleNamespace(filesystem=LocalFileSystem(), path=str(ckpt)), {**settings, **sets})
        log.poll(now=True)

    validate(RuntimeError, "illegal memory access")
    validate(KeyboardInterrupt)  # its process ended with its launch: no record
    validate(RuntimeError, "out of memory")
    assert len(outcomes) == 1 and runner.MAX_ATTEMPTS == 3
    validate(runner.EvaluationGaveUp, "not evaluated again: 3 attempts started across the run's launches .*the "
                                      "last: RuntimeError: CUDA error: out of memory")
    gave_up = read_failure(ckpt)
    validate(runner.EvaluationGaveUp, "not evaluated again")  # a later launch's request: nothing new
    assert read_failure(ckpt) == gave_up and len(outcomes) == 1
    events = [m for m in read_metrics(run) if m.get("event") == "gen_eval_failed"]
    assert [e["outcome"] for e in events] == ["failed", "failed", "gave_up"], events
    validate(RuntimeError, "another key's own failure", max_new_tokens=7)  # attempted: its first
    assert not outcomes


def test_an_attempt_that_ended_without_a_record_is_recorded_as_interrupted_once_by_the_driver(tmp_path, monkeypatch):
    """Ray cancels a validation without a record when its run aborts (the cancel reaches the evaluation as a
    KeyboardInterrupt) and force-cancels it at its own timeout. The driver's look (before a launch, once a run's
    validations ended) records each checkpoint whose last counted attempt has no record after it as interrupted,
    naming the attempt: one gen_eval_failed event, once. A checkpoint whose attempt recorded its failure or result,
    one the run gave up on, and one never attempted are left as they are."""
    from dataclasses import asdict

    from pyarrow.fs import LocalFileSystem

    import raysft.evals.runner as runner
    from raysft.checkpoint.gen_record import count_attempt
    from raysft.evals.validation import validate_checkpoint

    run = tmp_path / "run"
    ckpts = {step: fake_checkpoint(run, step) for step in (2, 4, 6, 8, 10)}
    monkeypatch.setattr(runner, "read_trainer_state", lambda ckpt: {"step": int(Path(ckpt).name[-8:])})
    outcomes = {2: [KeyboardInterrupt()], 4: [RuntimeError("CUDA error: out of memory"), KeyboardInterrupt()],
                6: [RuntimeError("no vLLM")]}
    monkeypatch.setattr(runner, "evaluate", lambda ckpt, *args, **kwargs: (_ for _ in ()).throw(
        outcomes[int(Path(ckpt).name[-8:])].pop(0)))
    settings = asdict(GenEvalConfig(path="builtin:demo-eval"))

    def validate(step: int, raises) -> None:
        with pytest.raises(raises):
            validate_checkpoint(SimpleNamespace(filesystem=LocalFileSystem(), path=str(ckpts[step])), settings)

    validate(2, KeyboardInterrupt)  # cancelled: no record
    validate(4, RuntimeError)  # recorded; its second attempt cancelled
    validate(4, KeyboardInterrupt)
    validate(6, RuntimeError)  # recorded
    key = runner.evaluation_key(GenEvalConfig(path="builtin:demo-eval"), "", "hf")
    for _ in range(4):  # the run gave up on step 8 (its 4th request recorded it), a 5th request leaves no record
        count_attempt(ckpts[8], key)
    runner.record_failure(ckpts[8], GenEvalConfig(path="builtin:demo-eval"), "", "hf", "not evaluated again", "gave_up")
    count_attempt(ckpts[8], key)
    # step 10 never attempted

    assert runner.record_unrecorded_attempts(run, "Ray cancelled it") == ["checkpoint_00000002", "checkpoint_00000004"]
    for step, attempt in ((2, 1), (4, 2)):
        failure = read_failure(ckpts[step])
        assert failure["kind"] == "interrupted" and failure["step"] == step and failure["key"] == key, failure
        assert f"attempt {attempt} of its evaluation, started " in failure["reason"]
        assert failure["reason"].endswith("ended without a record: Ray cancelled it")
    assert read_failure(ckpts[6])["reason"] == "RuntimeError: no vLLM" and read_failure(ckpts[8])["kind"] == "gave_up"
    assert read_failure(ckpts[10]) is None
    assert runner.record_unrecorded_attempts(run, "Ray cancelled it") == []  # once
    GenEvalLog(run, MetricsLogger(run, 10, 1)).poll(now=True)
    events = [(m["step"], m["outcome"]) for m in read_metrics(run) if m.get("event") == "gen_eval_failed"]
    assert sorted(events) == [(2, "interrupted"), (4, "interrupted"), (6, "failed"), (8, "gave_up")], events

    # the next launch's attempt at step 2 finishes: its result follows the interruption, nothing more is recorded
    monkeypatch.setattr(runner, "evaluate", lambda *args, **kwargs: (
        {"metrics": {"gen/contains": 1.0}, "key": key, "finished": 2000.0}, []))
    validate_checkpoint(SimpleNamespace(filesystem=LocalFileSystem(), path=str(ckpts[2])), settings)
    assert read_result(ckpts[2])["metrics"] == {"gen/contains": 1.0} and read_failure(ckpts[2]) is None
    assert runner.record_unrecorded_attempts(run, "Ray cancelled it") == []


@pytest.fixture(scope="module")
def llama3_model(tmp_path_factory) -> Path:
    """A tiny random model with Llama 3.1's tokenizer setup: a BOS that its chat template writes, tools rendered
    into the prompt, <|eot_id|> ending a turn."""
    from test_labels import model_tokenizer
    from tokenizers.processors import TemplateProcessing

    tok = model_tokenizer("meta-llama-Llama-3.1-8B-Instruct")
    bos = tok.bos_token  # tokenizing text adds it, as Llama 3's tokenizer does (where a rendered template has one)
    tok.backend_tokenizer.post_processor = TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                              special_tokens=[(bos, tok.bos_token_id)])
    assert tok("hi")["input_ids"][0] == tok.bos_token_id
    return saved_tiny_model(tok, tmp_path_factory.mktemp("llama3") / "model")


def test_both_engines_ask_the_model_with_the_tokens_training_put_before_the_answer(llama3_model, monkeypatch):
    """What the model is asked is what it learned to answer: each row the hf engine feeds generate (without its
    left padding) and each prompt the vLLM engine hands Ray Data's processor is the token sequence that training put
    before the assistant's answer of the same conversation: one BOS, the tools, a system prompt and earlier turns.
    Ray's processor passes the row on unchanged (built with Ray's API: tests/test_train_ray.py)."""
    import ray.data

    from raysft.data.conversation import Conversation
    from raysft.data.labels import IGNORE_INDEX, label_conversation
    from raysft.evals.engines import VllmEngine, tokenizer_and_stops
    from raysft.evals.evalset import EvalSample

    tool = {"type": "function", "function": {"name": "add_numbers", "description": "Add two numbers.",
                                             "parameters": {"type": "object", "properties": {}}}}
    samples = [EvalSample(where="line 1", messages=[{"role": "user", "content": "What is 2 plus 3?"}], expected="5",
                          tools=[tool]),
               EvalSample(where="line 2", messages=[{"role": "system", "content": "Be brief."},
                                                    {"role": "user", "content": "Capital of Peru?"},
                                                    {"role": "assistant", "content": "Lima."},
                                                    {"role": "user", "content": "And of Chile?"}], expected="Santiago")]
    settings = GenEvalConfig(path="x", max_new_tokens=2, batch_size=2)
    engine = HfEngine(llama3_model, settings)
    hf_fed, generate = [], engine.chat.model.generate

    def seen(input_ids, attention_mask, **options):
        hf_fed.extend(row[mask.bool()].tolist() for row, mask in zip(input_ids, attention_mask, strict=True))
        return generate(input_ids=input_ids, attention_mask=attention_mask, **options)

    monkeypatch.setattr(engine.chat.model, "generate", seen)
    engine.generate(samples)
    assert len(hf_fed) == 2 and len(hf_fed[0]) != len(hf_fed[1])  # one batch, a row padded

    vllm = object.__new__(VllmEngine)  # its processor needs vLLM to run: the rows it is handed are recorded
    vllm.settings, (vllm.tokenizer, vllm.stop_ids) = settings, tokenizer_and_stops(llama3_model)
    vllm_fed = []
    vllm.processor = lambda rows: SimpleNamespace(take_all=lambda: [
        vllm_fed.append(r["ids"]) or {"index": r["index"], "tokens": vllm.stop_ids[:1]} for r in rows])
    monkeypatch.setattr(ray.data, "from_items", lambda rows: rows)
    vllm.generate(samples)

    tokenizer = engine.chat.tokenizer
    for sample in samples:
        answered = Conversation([*sample.messages, {"role": "assistant", "content": sample.expected}], sample.tools)
        trained = label_conversation(tokenizer, answered, 1024, train_on="last_assistant")
        before = trained.input_ids[:next(i for i, label in enumerate(trained.labels) if label != IGNORE_INDEX)]
        assert before in hf_fed, ("hf", sample.where, tokenizer.decode(before), [tokenizer.decode(f) for f in hf_fed])
        assert before in vllm_fed, ("vllm", sample.where, tokenizer.decode(before))
        assert before.count(tokenizer.bos_token_id) == 1
    assert "add_numbers" in tokenizer.decode(vllm_fed[0])  # the tools are in the prompt


def test_what_an_evaluation_reads_before_it_generates_fails_as_the_rest_does_recorded(tmp_path):
    """The checkpoint's trainer state and the eval set are read before anything is generated: a failure there is
    recorded as any other (failed.json, one gen_eval_failed event), an eval set missing where the evaluation runs
    naming its path and the node."""
    import socket

    from raysft.checkpoint import CheckpointError
    from raysft.evals.runner import evaluate_checkpoint

    run = tmp_path / "run"
    ckpt = fake_checkpoint(run, 4)  # its trainer state lacks what this raysft writes
    eval_set = Path(write_lines(tmp_path / "eval.jsonl", {"prompt": "What is 2 plus 3?", "answer": "5"}))
    log = GenEvalLog(run, MetricsLogger(run, 8, 1))
    with pytest.raises(CheckpointError):
        evaluate_checkpoint(ckpt, GenEvalConfig(path=str(eval_set)))
    assert read_failure(ckpt)["reason"].startswith(f"CheckpointError: {ckpt / STATE_FILE}"), read_failure(ckpt)
    assert log.poll(now=True) == 1
    eval_set.unlink()  # gone from this node
    with pytest.raises(DataError):
        evaluate_checkpoint(ckpt, GenEvalConfig(path=str(eval_set)))
    failure = read_failure(ckpt)
    assert failure["reason"] == f"DataError: eval.path: {eval_set} is not a file on node {socket.gethostname()}"
    assert failure["kind"] == "failed" and failure["key"] is None and failure["step"] == 4
    assert log.poll(now=True) == 1
    assert [e["reason"].split(":")[0] for e in read_metrics(run) if e.get("event") == "gen_eval_failed"] == [
        "CheckpointError", "DataError"]
