"""The embedded demo's assets: synthetic conversations, a byte-level BPE tokenizer trained on them, and
preference pairs of the same questions (right and wrong answers) for the DPO demo.

Nothing may come from a model hub, so the project makes its own. The files are shipped in raysft/assets/demo;
`python -m raysft.data.demo` regenerates them (deterministically) after a change here.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

DEMO_DIR = Path(__file__).parent.parent / "assets" / "demo"
DEMO_CONVERSATIONS = DEMO_DIR / "conversations.json"
DEMO_PREFERENCES = DEMO_DIR / "preferences.json"
DEMO_EVAL = DEMO_DIR / "eval.jsonl"  # builtin:demo-eval, the generation evaluation of jobs/configs/demo.yaml
DEMO_TOKENIZER = DEMO_DIR / "tokenizer"

# Assistant text is wrapped in {% generation %} so transformers can return the assistant-token mask.
DEMO_CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "{{ '<|assistant|>\\n' }}{% generation %}{{ m['content'] + '<|end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{%- else -%}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '<|end|>\\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- endif -%}"
)
SPECIAL_TOKENS = ["<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]

_CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo",
    "Canada": "Ottawa", "Egypt": "Cairo", "Kenya": "Nairobi", "Peru": "Lima", "Norway": "Oslo",
    "Greece": "Athens", "Poland": "Warsaw", "Chile": "Santiago", "India": "New Delhi", "China": "Beijing",
}
_OPPOSITES = {"hot": "cold", "big": "small", "fast": "slow", "up": "down", "light": "dark", "old": "new",
              "happy": "sad", "early": "late", "open": "closed", "strong": "weak"}
_COLORS = {"the sky": "blue", "grass": "green", "snow": "white", "coal": "black", "a banana": "yellow",
           "a tomato": "red", "an orange": "orange", "a plum": "purple"}
_SYSTEM = "You are a helpful assistant. Answer in one short sentence."


def _qa(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(4)
    if kind == 0:
        country = rng.choice(list(_CAPITALS))
        return f"What is the capital of {country}?", f"The capital of {country} is {_CAPITALS[country]}."
    if kind == 1:
        word = rng.choice(list(_OPPOSITES))
        return f"What is the opposite of {word}?", f"The opposite of {word} is {_OPPOSITES[word]}."
    if kind == 2:
        thing = rng.choice(list(_COLORS))
        return f"What color is {thing}?", f"{thing[0].upper() + thing[1:]} is {_COLORS[thing]}."
    a, b = rng.randrange(10), rng.randrange(10)
    return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."


def make_demo_conversations(n: int = 1200, seed: int = 0) -> list[dict]:
    """ShareGPT-format records of one to three question/answer turns, some with a system prompt."""
    rng = random.Random(seed)
    records = []
    for i in range(n):
        turns = [{"from": "system", "value": _SYSTEM}] if rng.random() < 0.25 else []
        for _ in range(rng.choice((1, 1, 2, 3))):
            question, answer = _qa(rng)
            turns += [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]
        records.append({"id": f"demo-{i}", "conversations": turns})
    return records


def _wrong(answer: str, rng: random.Random) -> str:
    """The answer with its last word replaced by a wrong one of the same kind (another capital, colour, sum...)."""
    words = answer[:-1].split(" ")
    last = words[-1]
    if last.isdigit():
        wrong = str((int(last) + rng.randrange(1, 9)) % 19)
    else:
        kinds = [[v.split(" ")[-1] for v in kind.values()] for kind in (_CAPITALS, _OPPOSITES, _COLORS)]
        wrong = rng.choice([w for w in next(k for k in kinds if last in k) if w != last])
    return " ".join([*words[:-1], wrong]) + "."


def make_demo_preferences(n: int = 400, seed: int = 1) -> list[dict]:
    """TRL-format preference pairs (conversational, explicit prompt): the demo's questions, answered right
    (chosen) and with a wrong fact (rejected); some open with the demo's system prompt."""
    rng = random.Random(seed)
    records = []
    for i in range(n):
        question, answer = _qa(rng)
        prompt = [{"role": "system", "content": _SYSTEM}] if rng.random() < 0.25 else []
        prompt.append({"role": "user", "content": question})
        records.append({"id": f"demo-pref-{i}", "prompt": prompt,
                        "chosen": [{"role": "assistant", "content": answer}],
                        "rejected": [{"role": "assistant", "content": _wrong(answer, rng)}]})
    return records


# The one question of the demo's 133 that its 1,200 training conversations never ask: the eval set holds it out.
HELD_OUT = ("What is 2 plus 7?",)
_EVAL_SUMS = [(2, 7), (3, 4), (0, 9), (5, 5), (8, 1), (6, 3), (9, 9)]


def _answer(question: str) -> str:
    """The demo's answer to one of its questions (the sentence _qa pairs with it)."""
    for country, capital in _CAPITALS.items():
        if question == f"What is the capital of {country}?":
            return f"The capital of {country} is {capital}."
    for word, opposite in _OPPOSITES.items():
        if question == f"What is the opposite of {word}?":
            return f"The opposite of {word} is {opposite}."
    for thing, color in _COLORS.items():
        if question == f"What color is {thing}?":
            return f"{thing[0].upper() + thing[1:]} is {color}."
    a, b = (int(w) for w in question.removeprefix("What is ").removesuffix("?").split(" plus "))
    return f"{a} plus {b} is {a + b}."


def make_demo_eval() -> list[dict]:
    """40 of the demo's questions with the demo's answers (builtin:demo-eval): every capital, opposite and color
    question, and 7 sums. All but HELD_OUT occur in the training conversations, so a trained demo model should
    answer nearly all of them word for word; its untrained start, none."""
    questions = ([f"What is the capital of {c}?" for c in _CAPITALS] + [f"What is the opposite of {w}?" for w in
                 _OPPOSITES] + [f"What color is {t}?" for t in _COLORS] + [f"What is {a} plus {b}?" for a, b in
                                                                           _EVAL_SUMS])
    return [{"id": f"demo-eval-{i}", "prompt": q, "answer": _answer(q), "held_out": q in HELD_OUT}
            for i, q in enumerate(questions)]


def train_demo_tokenizer(texts: list[str], vocab_size: int = 512):
    """A byte-level BPE (so any text encodes) wrapped for transformers, with the demo chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<|pad|>", eos_token="<|end|>", chat_template=DEMO_CHAT_TEMPLATE
    )


def write_demo_assets(out_dir: Path = DEMO_DIR) -> None:
    records = make_demo_conversations()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "conversations.json").write_text(json.dumps(records, indent=1) + "\n")
    texts = [turn["value"] for record in records for turn in record["conversations"]]
    train_demo_tokenizer(texts).save_pretrained(out_dir / "tokenizer")
    (out_dir / "preferences.json").write_text(json.dumps(make_demo_preferences(), indent=1) + "\n")
    write_demo_eval(out_dir)


def write_demo_eval(out_dir: Path = DEMO_DIR) -> None:
    (out_dir / DEMO_EVAL.name).write_text("".join(json.dumps(r) + "\n" for r in make_demo_eval()))


if __name__ == "__main__":
    write_demo_assets()
    print(f"wrote {DEMO_DIR}")
