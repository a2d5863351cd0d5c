"""`raysft chat` and `raysft report` on a run trained for real: 6 steps with full checkpoints, then the same run
continued to step 9 with sharded ones (a resume, which the report marks)."""

import itertools
import json
import re
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
from conftest import REPO, cli_env, cli_in_process
from conftest import run_cli as raysft

from raysft.config import ModelConfig
from raysft.data.tokenizer import load_tokenizer
from raysft.products.chat_model import ChatModel
from raysft.products.export import export
from raysft.tools.chat import Conversation, generate_answer
from raysft.tools.report import draw, read_curves

Q1, Q2 = "What is the capital of France?", "And of Spain?"
TOKENS = "24"  # --max-new-tokens: enough to tell answers apart, cheap on 2 cores


@pytest.fixture(scope="module")
def run(tmp_path_factory, gloo_pool):
    """A run of the demo config with a full checkpoint (step 6) and a sharded one (step 9), trained on two gloo
    processes (the CLI's own training is tested in tests/test_cli.py)."""
    from raysft.config import load_config
    from raysft.launch.torchrun import launch

    root = tmp_path_factory.mktemp("chat")
    common = ["data.max_seq_len=96", "checkpoint.every_n_steps=3", "checkpoint.keep=3", f"run.storage_path={root}",
              "run.name=chat", "eval.path="]  # no generation evaluation: tests/test_gen_eval.py
    for extra in (["train.max_steps=6", "checkpoint.mode=full"], ["train.max_steps=9", "checkpoint.mode=sharded"]):
        gloo_pool.run(launch, load_config(REPO / "jobs" / "configs" / "demo.yaml", [*common, *extra]))
    run_dir = root / "chat"
    full, sharded = run_dir / "checkpoint_00000006", run_dir / "checkpoint_00000009"
    assert (full / "model.safetensors").is_file() and list(sharded.glob("*.distcp"))
    with cli_env() as env:
        yield SimpleNamespace(dir=run_dir, env=env, full=full, sharded=sharded,
                              full_hf=export(full, root / "hf6"), sharded_hf=export(sharded, root / "hf9"))


@pytest.mark.slow  # trains for tens of seconds on 2 cores: make test-fast leaves it out
@pytest.mark.parametrize("source", ["full", "sharded", "full_hf"])
def test_chat_prompt_answers_like_generate_answer_on_the_exported_model(run, source):
    out = cli_in_process("chat", str(getattr(run, source)), "--prompt", Q1, "--max-new-tokens", TOKENS)
    assert out.returncode == 0, out.stderr[-3000:]
    exported = run.sharded_hf if source == "sharded" else run.full_hf
    assert out.stdout.strip() and out.stdout.strip() == generate_answer(exported, Q1, max_new_tokens=int(TOKENS))


def test_conversation_renders_the_history_with_the_training_template(run):
    model = ChatModel.load(run.sharded_hf)
    training_tokenizer = load_tokenizer(ModelConfig(), "auto")  # what the run rendered its data with
    assert model.tokenizer.chat_template == training_tokenizer.chat_template

    chat = Conversation(model, system="Answer briefly.", max_new_tokens=int(TOKENS))
    a1 = chat.ask(Q1)
    history = [*chat.messages, {"role": "user", "content": Q2}]
    rendered = model.render(history)
    assert rendered == training_tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
    assert rendered.index("Answer briefly.") < rendered.index(Q1) < rendered.index(a1) < rendered.index(Q2)
    chat.ask(Q2)
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant", "user", "assistant"]
    chat.reset()
    assert chat.messages == [{"role": "system", "content": "Answer briefly."}]


@pytest.mark.slow  # trains for tens of seconds on 2 cores: make test-fast leaves it out
def test_repl_over_piped_stdin_keeps_the_history_resets_and_exits(run):
    model = ChatModel.load(run.sharded_hf)
    chat = Conversation(model, max_new_tokens=int(TOKENS))
    a1, a2 = chat.ask(Q1), chat.ask(Q2)
    fresh = model.reply([{"role": "user", "content": Q2}], int(TOKENS))
    assert a2 != fresh  # so the REPL's second answer below shows it saw the first turn

    out = raysft("chat", str(run.sharded), "--max-new-tokens", TOKENS, env=run.env,
                 input=f"{Q1}\n{Q2}\n/reset\n{Q2}\n/exit\n{Q1}\n")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout == (f"user> assistant> {a1}\nuser> assistant> {a2}\nuser> (conversation cleared)\n"
                          f"user> assistant> {fresh}\nuser> ")  # nothing after /exit

    eof = raysft("chat", str(run.full_hf), "--max-new-tokens", TOKENS, env=run.env, input=f"{Q1}\n")
    assert eof.returncode == 0, eof.stderr[-3000:]
    assert eof.stdout == f"user> assistant> {generate_answer(run.full_hf, Q1, int(TOKENS))}\nuser> \n"


def test_generate_and_chat_stop_where_the_exported_generation_config_says(run, tmp_path):
    """Plain `generate` on an export, given no stop token, ends the answer where chat does (generation_config.json
    holds the template's end of turn); a stop listed only in generation_config.json ends chat's reply too."""
    from transformers import AutoModelForCausalLM

    # Barely trained models: some answer every prompt with one token, which cannot show a listed stop cutting an
    # answer short; the first export and prompt with a longer answer serve for that, every one tried for the rest.
    for exported, question in itertools.product((run.full_hf, run.sharded_hf), (Q1, Q2, "Tell me about the ocean.")):
        chat, model = ChatModel.load(exported), AutoModelForCausalLM.from_pretrained(exported)
        messages = [{"role": "user", "content": question}]
        inputs = chat.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                    return_dict=True)
        plain = model.generate(**inputs, max_new_tokens=64, do_sample=False)
        answer = plain[0, inputs["input_ids"].shape[1]:].tolist()
        assert answer[-1] in chat.stop_ids and len(answer) < 64  # it stopped, at a stop token
        assert chat.tokenizer.decode(answer, skip_special_tokens=True).strip() == chat.reply(messages, 64)
        if len(answer) > 2:
            break
    first = answer[0]
    assert first not in chat.stop_ids and len(answer) > 2, f"every prompt got a one-token answer: {answer}"
    listed = tmp_path / "hf"
    shutil.copytree(exported, listed)
    config = json.loads((listed / "generation_config.json").read_text())
    config["eos_token_id"] = [*config["eos_token_id"], first] if isinstance(config["eos_token_id"], list) else [
        config["eos_token_id"], first]
    (listed / "generation_config.json").write_text(json.dumps(config))
    stopped = ChatModel.load(listed).reply(messages, 64)
    assert stopped == chat.tokenizer.decode([first], skip_special_tokens=True).strip()


def test_chat_refuses_an_incomplete_checkpoint_naming_it(run, tmp_path):
    no_manifest = tmp_path / "full"
    shutil.copytree(run.full, no_manifest)
    (no_manifest / "manifest.json").unlink()
    out = cli_in_process("chat", str(no_manifest), "--prompt", Q1)
    assert out.returncode == 1
    assert f"{no_manifest}: incomplete checkpoint: no manifest.json" in out.stderr

    truncated = tmp_path / "sharded"
    shutil.copytree(run.sharded, truncated)
    shard = truncated / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    out = cli_in_process("chat", str(truncated), "--prompt", Q1)
    assert out.returncode == 1
    assert f"{truncated}: incomplete checkpoint: __1_0.distcp has 100 bytes" in out.stderr

    with pytest.raises(FileNotFoundError, match=re.escape(f"{tmp_path}: neither an HF model directory")):
        ChatModel.load(tmp_path)


def test_report_draws_loss_and_throughput_of_the_run(run, tmp_path):
    import matplotlib.image

    out = cli_in_process("report", str(run.dir))
    assert out.returncode == 0, out.stderr[-3000:]
    png = run.dir / "report.png"
    rows = [json.loads(line) for line in (run.dir / "metrics.jsonl").read_text().splitlines()]
    final_loss = [r for r in rows if r.get("step") == 9 and "event" not in r][-1]["loss"]
    assert f"raysft: report {png}\n" in out.stdout
    assert f"9 steps (last 9), final loss {final_loss:.4f}, median " in out.stdout
    assert "checkpoints 3, resumes 1" in out.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    assert matplotlib.image.imread(png).shape == (600, 900, 4)  # figsize 9 x 6 at 100 dpi, RGBA

    elsewhere = tmp_path / "plots" / "curves.png"
    out = cli_in_process("report", str(run.dir), "--out", str(elsewhere))
    assert out.returncode == 0 and f"raysft: report {elsewhere}\n" in out.stdout and elsewhere.is_file()


def test_report_keeps_the_surviving_history_after_a_resume(tmp_path):
    def step(s, loss):
        return json.dumps({"step": s, "time": 0, "loss": loss, "tokens_per_s": 100.0 * s})

    # steps 1-5, a crash (and a line cut short), a resume from the checkpoint at 3 that ran to step 4 only
    lines = [json.dumps({"event": "start"}), *(step(s, 10 - s) for s in range(1, 6)), '{"step": 6, "lo',
             json.dumps({"event": "checkpoint", "step": 3}), json.dumps({"event": "resume", "step": 3}), step(4, 0.5)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    curves = read_curves(tmp_path)
    assert {s: r["loss"] for s, r in curves.steps.items()} == {1: 9, 2: 8, 3: 7, 4: 0.5}
    assert curves.unreadable_lines == 1
    assert curves.summary() == "4 steps (last 4), final loss 0.5000, median 250 tokens/s, checkpoints 1, resumes 1"


def test_report_draws_the_eval_loss_beside_the_training_loss(tmp_path):
    import matplotlib.image
    import numpy as np

    def rows(with_eval: bool) -> str:
        return "\n".join(json.dumps({"step": s, "time": 0, "loss": 3 - 0.1 * s, "tokens_per_s": 100.0,
                                      **({"eval_loss": 3.5 - 0.05 * s, "eval_s": 0.2} if with_eval and s % 4 == 0
                                         else {})}) for s in range(1, 13)) + "\n"

    orange = []  # matplotlib's tab:orange, the eval curve's colour, in each picture
    for with_eval in (True, False):
        (tmp_path / "metrics.jsonl").write_text(rows(with_eval))
        curves = read_curves(tmp_path)
        image = matplotlib.image.imread(draw(curves, tmp_path / f"{with_eval}.png"))[..., :3]
        orange.append(int((np.abs(image - np.array([1.0, 0.498, 0.055])).max(-1) < 0.05).sum()))
    (tmp_path / "metrics.jsonl").write_text(rows(True))
    assert read_curves(tmp_path).eval_losses() == pytest.approx({4: 3.3, 8: 3.1, 12: 2.9})
    assert "final loss 1.8000, best eval loss 2.9000 (step 12)," in read_curves(tmp_path).summary()
    assert orange[0] > 100 and orange[1] == 0


def test_report_without_metrics_fails_naming_the_file(tmp_path):
    out = cli_in_process("report", str(tmp_path))
    assert out.returncode == 1 and f"{tmp_path / 'metrics.jsonl'}: no metrics file" in out.stderr
    assert not (tmp_path / "report.png").exists()
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"event": "start"}) + "\n")
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'metrics.jsonl'}: no training steps recorded")):
        read_curves(tmp_path)


@pytest.mark.slow  # trains for tens of seconds on 2 cores: make test-fast leaves it out
def test_report_without_matplotlib_says_how_to_install_it(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0, "tokens_per_s": 1.0}) + "\n")
    block = "import sys; sys.modules['matplotlib'] = None; from raysft.cli import main; "  # its import now fails
    out = subprocess.run([sys.executable, "-c", block + f"sys.exit(main(['report', {str(tmp_path)!r}]))"],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 1 and "pip install 'raysft[report]'" in out.stderr
    assert not (tmp_path / "report.png").exists()


def test_loading_a_model_to_answer_prints_no_progress_bar_and_leaves_the_setting_as_it_was(tmp_path, capfd):
    """`make demo` ends with the answer (`raysft train --export DIR --prompt`), not transformers' "Loading weights"
    bar before it; a caller's own setting of transformers' progress bars is the same after the load."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    from raysft.model.build import preset_config

    tok = load_tokenizer(ModelConfig(), "auto")
    LlamaForCausalLM(preset_config("demo-tiny", tok)).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    before = hf_logging.is_progress_bar_enabled()
    try:
        hf_logging.enable_progress_bar()
        capfd.readouterr()
        AutoModelForCausalLM.from_pretrained(tmp_path)
        assert "Loading weights" in capfd.readouterr().err, "transformers draws no bar here: the test sees nothing"
        for bars_on in (True, False):
            (hf_logging.enable_progress_bar if bars_on else hf_logging.disable_progress_bar)()
            generate_answer(tmp_path, Q1, max_new_tokens=2)
            assert "Loading weights" not in capfd.readouterr().err, "a progress bar before the answer"
            assert hf_logging.is_progress_bar_enabled() == bars_on, "the caller's progress-bar setting changed"
    finally:
        (hf_logging.enable_progress_bar if before else hf_logging.disable_progress_bar)()
