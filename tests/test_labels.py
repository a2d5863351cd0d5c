"""Assistant-only labels on real chat templates (tests/data/chat_templates) and on templates written here for
each way the earlier prefix-rendering method went wrong. The check is always the same: the supervised tokens,
decoded run by run, are exactly each assistant text plus the end-of-turn token the template writes after it."""

import json
import random

import pytest
from conftest import TEST_DATA
from transformers import AutoTokenizer

from raysft.data.conversation import BadRecord, to_conversation
from raysft.data.demo import DEMO_CHAT_TEMPLATE, DEMO_TOKENIZER
from raysft.data.labels import IGNORE_INDEX, label_conversation, marks_generation
from raysft.data.tokenizer import VICUNA_TEMPLATE

TEMPLATES = TEST_DATA / "chat_templates"
# Each model's special tokens ("special") and its added tokens that are plain text ("plain"), as its tokenizer has them.
QWEN_PLAIN = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
MODELS = {
    "Qwen-Qwen2.5-7B-Instruct": dict(eos="<|im_end|>", special=["<|im_start|>", "<|endoftext|>"], plain=QWEN_PLAIN),
    "Qwen-Qwen3-0.6B": dict(eos="<|im_end|>", special=["<|im_start|>", "<|endoftext|>"], plain=QWEN_PLAIN),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": dict(
        bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>", special=[],
        plain=["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
               "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"]),
    "meta-llama-Llama-3.1-8B-Instruct": dict(
        bos="<|begin_of_text|>", eos="<|eot_id|>",
        special=["<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>", "<|end_of_text|>"]),
    "mistralai-Mistral-Nemo-Instruct-2407": dict(
        bos="<s>", eos="</s>", special=["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                                        "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]),
    "google-gemma-2-2b-it": dict(bos="<bos>", eos="<eos>", special=["<start_of_turn>", "<end_of_turn>"]),
}
END_OF_TURN = {"Qwen-Qwen2.5-7B-Instruct": "<|im_end|>", "Qwen-Qwen3-0.6B": "<|im_end|>",
               "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": "<｜end▁of▁sentence｜>",
               "meta-llama-Llama-3.1-8B-Instruct": "<|eot_id|>", "mistralai-Mistral-Nemo-Instruct-2407": "</s>",
               "google-gemma-2-2b-it": "<end_of_turn>"}
NO_SYSTEM_ROLE = {"google-gemma-2-2b-it"}
USER_FIRST_ONLY = {"google-gemma-2-2b-it", "mistralai-Mistral-Nemo-Instruct-2407"}
NO_TOOL_CALLS = {"google-gemma-2-2b-it", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B"}  # see test below

CHATML_TURN = "'<|im_start|>' + m['role'] + '\\n' + m['content']"
# The three ways the prefix-rendering method mislabelled, each as a small ChatML template:
OWN_TEMPLATES = {
    # the generation prompt opens more than the history holds at that place (DeepSeek-R1's "<think>\n")
    "generation_prompt_differs": (
        "{%- for m in messages -%}{{ " + CHATML_TURN + " + '<|im_end|>\\n' }}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n<think>\\n' }}{%- endif -%}"),
    # the system text moves into the last user turn (Mistral-Nemo), so prefixes render longer than the whole
    "moves_system_text": (
        "{%- set sys = messages[0]['content'] if messages[0]['role'] == 'system' else '' -%}"
        "{%- set msgs = messages[1:] if sys else messages -%}"
        "{%- set last_user = (msgs | selectattr('role', 'equalto', 'user') | list | last) -%}"
        "{%- for m in msgs -%}{%- if m['role'] == 'user' and m is sameas last_user and sys -%}"
        "{{ '<|im_start|>user\\n' + sys + '\\n\\n' + m['content'] + '<|im_end|>\\n' }}"
        "{%- else -%}{{ " + CHATML_TURN + " + '<|im_end|>\\n' }}{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"),
    # the end-of-turn token is written only when another message follows
    "end_of_turn_only_between": (
        "{%- for m in messages -%}{{ " + CHATML_TURN + " }}{%- if not loop.last -%}{{ '<|im_end|>\\n' }}{%- endif -%}"
        "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|im_end|>\\n<|im_start|>assistant\\n' }}{%- endif -%}"),
}
CHATML = {"eos": "<|im_end|>", "special": ["<|im_start|>"]}

SYSTEM = {"role": "system", "content": "Be brief."}
TURNS = [{"role": "user", "content": "What is 2 plus 3?"}, {"role": "assistant", "content": "5."},
         {"role": "user", "content": "And the capital of Peru?"},
         {"role": "assistant", "content": "The capital of Peru is Lima."}]
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
TOOLS = [{"type": "function", "function": WEATHER}]
OPENAI_CALL = [
    {"role": "user", "content": "Weather in Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "abcdefghi", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "tool_call_id": "abcdefghi", "content": "sunny, 25C"},
    {"role": "assistant", "content": "It is sunny in Rome."}]


def tokenizer_with(template: str, eos: str, special: list[str], plain: list[str] = (), bos: str | None = None,
                   source: str = "test"):
    tok = AutoTokenizer.from_pretrained(DEMO_TOKENIZER)
    tok.add_special_tokens({"additional_special_tokens": special, "eos_token": eos,
                            **({"bos_token": bos} if bos else {})})
    tok.add_tokens(list(plain))
    tok.chat_template, tok.chat_template_source = template, source
    return tok


def model_tokenizer(name: str):
    return tokenizer_with((TEMPLATES / f"{name}.jinja").read_text(), source=name, **MODELS[name])


def supervised(tok, record, train_on="all_assistant"):
    """The supervised tokens, decoded one contiguous run at a time, and the count of rewritten turns."""
    out = label_conversation(tok, to_conversation(record), 100_000, train_on)
    runs, run = [], []
    for token, label in zip(out.input_ids, out.labels, strict=True):
        if label != IGNORE_INDEX:
            assert label == token
            run.append(token)
        elif run:
            runs.append(tok.decode(run))
            run = []
    return runs + ([tok.decode(run)] if run else []), out.rewritten_turns


@pytest.mark.parametrize("name", MODELS)
def test_real_templates_label_each_answer_and_its_end_of_turn(name):
    tok, eot = model_tokenizer(name), END_OF_TURN[name]
    messages = TURNS if name in NO_SYSTEM_ROLE else [SYSTEM, *TURNS]
    assert supervised(tok, {"messages": messages}) == (["5." + eot, "The capital of Peru is Lima." + eot], 0)
    assert supervised(tok, {"messages": messages}, "last_assistant") == (["The capital of Peru is Lima." + eot], 0)


@pytest.mark.parametrize("name", MODELS)
def test_assistant_first_and_empty_answers(name):
    tok, eot = model_tokenizer(name), END_OF_TURN[name]
    record = {"messages": [{"role": "assistant", "content": "Hello! How can I help?"},
                           {"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}]}
    if name in USER_FIRST_ONLY:  # these templates refuse it themselves: a named refusal, never a guess
        with pytest.raises(BadRecord, match=f"{name} failed: .*alternate"):
            supervised(tok, record)
        record = {"messages": [TURNS[0], {"role": "assistant", "content": ""}, *TURNS[2:]]}
        assert supervised(tok, record)[0] == [eot, "The capital of Peru is Lima." + eot]
    else:
        assert supervised(tok, record)[0] == ["Hello! How can I help?" + eot, eot]


@pytest.mark.parametrize("name", MODELS)
def test_tool_calls_are_supervised_and_tool_results_are_not(name):
    tok, eot = model_tokenizer(name), END_OF_TURN[name]
    record = {"messages": OPENAI_CALL, "tools": TOOLS}
    if name in NO_TOOL_CALLS:
        # gemma has no tool role; DeepSeek-R1's template needs content None, which transformers drops
        with pytest.raises(BadRecord, match=f"{name} does not render tool calls"):
            supervised(tok, record)
        return
    (call, answer), _ = supervised(tok, record)
    assert answer == "It is sunny in Rome." + eot
    assert call.endswith(eot) and "get_weather" in call and '"city": "Rome"' in call
    assert "sunny, 25C" not in "".join([call, answer])
    # the call is all the assistant writes: the rendering holds it right after the turn's header
    messages = to_conversation({"messages": OPENAI_CALL}).messages  # arguments as the object templates expect
    rendered = tok.apply_chat_template(messages[:2], tools=TOOLS, tokenize=False)
    assert call.removesuffix(eot) in rendered
    # ShareGPT's function_call/observation turns are the same conversation
    sharegpt = {"conversations": [
        {"from": "human", "value": "Weather in Rome?"},
        {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Rome"}})},
        {"from": "observation", "value": "sunny, 25C"}, {"from": "gpt", "value": "It is sunny in Rome."}],
        "tools": json.dumps(TOOLS)}
    if "mistral" not in name:  # Mistral's template wants call ids, which ShareGPT has none of
        assert supervised(tok, sharegpt)[0] == [call, answer]


def test_reasoning_dropped_from_earlier_turns_is_labelled_as_rendered():
    tok = model_tokenizer("Qwen-Qwen3-0.6B")
    record = {"messages": [{"role": "user", "content": "2+3?"},
                           {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n5."},
                           {"role": "user", "content": "2+4?"},
                           {"role": "assistant", "content": "<think>\nagain\n</think>\n\n6."}]}
    assert supervised(tok, record) == (["5.<|im_end|>", "<think>\nagain\n</think>\n\n6.<|im_end|>"], 1)


@pytest.mark.parametrize("kind", OWN_TEMPLATES)
def test_templates_that_broke_prefix_labelling(kind):
    tok = tokenizer_with(OWN_TEMPLATES[kind], **CHATML)
    runs, _ = supervised(tok, {"messages": [SYSTEM, *TURNS]})
    # end_of_turn_only_between writes nothing after the last answer: raysft supervises its <|im_end|> there
    assert runs == ["5.<|im_end|>", "The capital of Peru is Lima.<|im_end|>"]


# vLLM's example ChatML template, verbatim (vllm-project/vllm, examples/template_chatml.jinja, Apache-2.0):
# `<|im_end|>` only when another message follows or a generation prompt is asked for.
VLLM_CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content']}}"
               "{% if (loop.last and add_generation_prompt) or not loop.last %}{{ '<|im_end|>' + '\\n'}}{% endif %}"
               "{% endfor %}{% if add_generation_prompt and messages[-1]['role'] != 'assistant' %}"
               "{{ '<|im_start|>assistant\\n' }}{% endif %}\n")


def test_a_template_that_leaves_the_last_answer_open_gets_its_end_of_turn_supervised():
    """Single-turn data on vLLM's ChatML: the rendering ends with the answer, no <|im_end|>; a model tuned on it
    would never learn to stop. The stop it writes between turns is supervised after the last answer, which is how
    a reply ends at inference (the generation prompt closes the user turn with the same token)."""
    tok = tokenizer_with(VLLM_CHATML, **CHATML)
    single = [{"role": "user", "content": "Capital of Peru?"}, {"role": "assistant", "content": "Lima."}]
    assert tok.apply_chat_template(single, tokenize=False).endswith("Lima.")
    assert supervised(tok, {"messages": single})[0] == ["Lima.<|im_end|>"]
    assert supervised(tok, {"messages": [SYSTEM, *TURNS]})[0] == ["5.<|im_end|>",
                                                                  "The capital of Peru is Lima.<|im_end|>"]
    empty = [single[0], {"role": "assistant", "content": ""}]  # nothing to say is still a reply that stops
    assert supervised(tok, {"messages": empty})[0] == ["<|im_end|>"]


def test_a_template_that_never_ends_an_answer_is_refused_by_name():
    plain = "{%- for m in messages -%}{{ m['role'] + ': ' + m['content'] + '\\n' }}{%- endfor -%}"
    tok = tokenizer_with(plain, source="plain-template", **CHATML)
    with pytest.raises(BadRecord, match="plain-template writes no end-of-turn token after an assistant turn"):
        supervised(tok, {"messages": TURNS})


def test_short_answer_keeps_its_first_tokens_when_the_generation_prompt_opens_more():
    tok = model_tokenizer("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B")
    assert tok.apply_chat_template(TURNS[:1], tokenize=False, add_generation_prompt=True).endswith("<think>\n")
    assert supervised(tok, {"messages": TURNS})[0][0] == "5.<｜end▁of▁sentence｜>"


@pytest.mark.parametrize("template", ["demo", "vicuna", "chatml"])
def test_generation_blocks_and_rendered_spans_agree(template):
    chatml = ("{%- for m in messages -%}{%- if m['role'] == 'assistant' -%}{{ '<|im_start|>assistant\\n' }}"
              "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
              "{%- else -%}{{ " + CHATML_TURN + " + '<|im_end|>\\n' }}{%- endif -%}{%- endfor -%}")
    source = {"demo": DEMO_CHAT_TEMPLATE, "vicuna": VICUNA_TEMPLATE, "chatml": chatml}[template]
    tagged = tokenizer_with(source, **CHATML)
    plain = tokenizer_with(source.replace("{% generation %}", "").replace("{% endgeneration %}", ""), **CHATML)
    assert marks_generation(tagged) and not marks_generation(plain)
    for record in ({"messages": [SYSTEM, *TURNS]}, {"messages": TURNS[:2]},
                   {"messages": [TURNS[0], {"role": "assistant", "content": " spaced \n"}]}):
        a, b = (label_conversation(t, to_conversation(record), 4096) for t in (tagged, plain))
        assert a.input_ids == b.input_ids and a.labels == b.labels


def test_a_template_that_inspects_the_text_is_refused_with_its_name():
    template = ("{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + '\\n' }}"
                "{%- if m['content'] | length > 12 -%}{{ 'LONG ' }}{%- endif -%}{{ m['content'] + '<|im_end|>\\n' }}"
                "{%- endfor -%}")
    tok = tokenizer_with(template, source="my-template.jinja", **CHATML)
    with pytest.raises(BadRecord, match="my-template.jinja renders assistant text differently"):
        supervised(tok, {"messages": TURNS[:2]})


def _random_text(rng: random.Random) -> str:
    words = ["Lima", "5.", "  ", "\n", "a", "<think>", "plus", "ASSISTANT:", "user", "é", "the", "\n\n", "?", "x y"]
    return "".join(rng.choice(words) + rng.choice(["", " "]) for _ in range(rng.randint(0, 8)))


@pytest.mark.parametrize("name", [*MODELS, *OWN_TEMPLATES])
def test_random_conversations_label_each_answer_as_rendered(name):
    """Any text, whitespace at either end, answers equal to the question: every record is labelled (none refused),
    and each supervised run is the answer (as the template trims it, if it does) and the end-of-turn token; never
    anything else."""
    if name in OWN_TEMPLATES:
        tok, eot = tokenizer_with(OWN_TEMPLATES[name], **CHATML), "<|im_end|>"
    else:
        tok, eot = model_tokenizer(name), END_OF_TURN[name]
    rng, labelled, refused = random.Random(0), 0, []
    for _ in range(30):
        messages = [] if name in NO_SYSTEM_ROLE or rng.random() < 0.5 else [{"role": "system", "content": "sys"}]
        answers = []
        for _ in range(rng.randint(1, 3)):
            question = _random_text(rng) or "q"
            answer = rng.choice([question, _random_text(rng), "ok"])
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            answers.append(answer)
        try:
            runs, rewritten = supervised(tok, {"messages": messages})
        except BadRecord as e:
            refused.append(str(e))
            continue
        labelled += 1
        for run, answer in zip(runs, answers, strict=True):
            body = run.removesuffix(eot)
            if not rewritten:
                assert body.strip() == answer.strip(), (name, messages, runs)
            assert eot not in body
    assert refused == [] and labelled == 30, (name, refused)


def test_store_manifest_says_how_labels_were_found(tmp_path):
    from raysft.config import DataConfig
    from raysft.data import prepare_store, read_store, read_store_manifest

    tok = model_tokenizer("Qwen-Qwen3-0.6B")
    thinking = {"messages": [{"role": "user", "content": "2+3?"},
                             {"role": "assistant", "content": "<think>\nadd\n</think>\n\n5."},
                             {"role": "user", "content": "2+4?"}, {"role": "assistant", "content": "6."}]}
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (thinking, {"messages": TURNS})) + "\n")
    every = prepare_store(DataConfig(paths=[str(path)]), tok, tmp_path / "store")
    manifest = read_store_manifest(every.path)
    assert manifest["labels"]["method"] == "rendered_spans" and manifest["labels"]["train_on"] == "all_assistant"
    assert manifest["labels"]["end_of_turn"] == ["<|im_end|>"] and manifest["labels"]["tool_calls"]
    assert manifest["counts"]["rewritten_turns"] == 1
    last = prepare_store(DataConfig(paths=[str(path)], train_on="last_assistant"), tok, tmp_path / "store")
    assert last.path != every.path  # other labels, another store
    loss_tokens = [read_store(s.path)["num_loss_tokens"].to_pylist() for s in (every, last)]
    assert all(a > b > 0 for a, b in zip(*loss_tokens, strict=True))


@pytest.mark.parametrize("name", MODELS)
def test_generation_stops_at_the_end_of_turn_token_the_template_writes(name):
    from raysft.data.labels import stop_token_ids

    tok = model_tokenizer(name)
    assert tok.convert_tokens_to_ids(END_OF_TURN[name]) in stop_token_ids(tok)
    assert tok.eos_token_id in stop_token_ids(tok)


# A base model tuned on an instruct template: its tokenizer's EOS ends a document, not an answer, so only the
# template's end-of-turn token stops `generate` after an answer.
BASE_EOS = {"meta-llama-Llama-3.1-8B-Instruct": "<|end_of_text|>", "Qwen-Qwen2.5-7B-Instruct": "<|endoftext|>"}


@pytest.mark.parametrize("name", BASE_EOS)
def test_an_export_of_a_base_model_on_a_llama3_or_chatml_template_stops_at_its_end_of_turn(name, tmp_path):
    from transformers import GenerationConfig

    from raysft.products.export import write_generation_config

    model = {**MODELS[name], "eos": BASE_EOS[name]}
    model["special"] = [t for t in model["special"] if t != BASE_EOS[name]] + [END_OF_TURN[name]]
    tok = tokenizer_with((TEMPLATES / f"{name}.jinja").read_text(), source=name, **model)
    tok.save_pretrained(tmp_path)
    write_generation_config(tmp_path)
    eos = GenerationConfig.from_pretrained(tmp_path).eos_token_id
    assert sorted(eos) == sorted(tok.convert_tokens_to_ids([END_OF_TURN[name], BASE_EOS[name]]))
