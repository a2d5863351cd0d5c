"""Scoring a generation against its expected answer, by scorers chosen by name (eval.scorers).

Each scorer is a plain function of (generation, expected, pattern, prompt) -> 1.0 or 0.0; none runs code from the
data or the config (eval.answer_pattern is a regular expression, matched, never evaluated). What each one compares:

  exact_match  the two texts equal after normalization (SQuAD's: lowercase, punctuation removed, no articles a/an/the,
               whitespace collapsed; Unicode NFKC first, so full-width digits and ligatures compare as their plain
               forms), except that a decimal point between digits stays ("3.5" is not "35")
  contains     the normalized expected answer occurs in the normalized generation as whole words ("4" is not in
               "14")
  regex        eval.answer_pattern's first match in the generation (the first of its groups that took part in the
               match, if it has groups, so each side of an alternation counts; else the whole match), normalized,
               equals the normalized expected answer; no match scores 0
  choice       the multiple-choice letter the generation gives equals the expected letter: after "answer" ("The
               answer is: B", "Answer: (b)"), after "option"/"choice", opening the answer ("B", "**B**", "(B)",
               "B, because", "b"), else the first in parentheses, else (when the prompt offers its options as
               "A." / "(A)" / "A)" lines) the first capital standing alone; only letters the prompt offers count
  number       the final number of the generation (after GSM8K's "####" if it writes one, else the one "answer
               is" gives, else its last number) equals the expected answer's, as decimals: "1,234" is 1234 but
               "1,2,3" is three numbers, "42.0" is 42, "$5" is 5, "−3" (a Unicode minus) is -3; where "answer is"
               opens a sum ("the answer is 3 + 4, so 7") the last number after it

`check_expected` refuses, before anything is generated, an expected answer that a scorer could never match (no
number for `number`, no letter for `choice`, nothing left after normalization), so that a data mistake is a named
bad record and not a silent 0.
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections.abc import Callable
from decimal import Decimal, InvalidOperation

_PUNCTUATION = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_DECIMAL_POINT = re.compile(r"(?<=\d)\.(?=\d)")
_KEPT_POINT = "\uE000"  # a private-use character standing for a decimal point while punctuation goes
# Minus signs and dashes a model writes for "-" (NFKC keeps them): U+2212 minus, U+2012 figure dash, U+FE63, U+FF0D.
_MINUS = str.maketrans({"\u2212": "-", "\u2012": "-", "\ufe63": "-", "\uff0d": "-"})
# A number not glued to a word before it ("x2" is no number; "5-3" is 5 and 3): digits, with commas only between
# groups of three ("1,234"; "1,2,3" is three numbers), an optional fraction, an optional sign and currency sign.
_NUMBER = re.compile(r"(?<![\w.])-?\$?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|(?<![\w.])-?\$?\.\d+")
_GSM8K_FINAL = re.compile(r"####\s*(.*)")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*(.*)", re.IGNORECASE | re.DOTALL)
_SUM_AFTER = re.compile(r"\s*[-+*/×x÷=]\s*\$?\d")  # after a number: it opens a sum, not the answer
# A letter after "answer" (is, :, =, "answer is option"): a capital standing alone, or a lower-case one in
# parentheses or before punctuation ("answer is a cat" gives none).
_CHOICE_AFTER_ANSWER = re.compile(r"(?i:answer)\s*(?:(?i:is)\s*)?[:=]?\s*(?:(?i:option|choice)\s+)?"
                                  r"(?:\(([A-Za-z])\)|([A-Z])(?![\w'])|([a-z])(?=[.,):;!]|\s*$))")
_CHOICE_AFTER_OPTION = re.compile(r"\b(?i:option|choice)\s*\(?([A-Z])\)?(?![\w'])")
# Opening the answer: a capital, or a lone lower-case letter, followed by punctuation or nothing ("A cat" is none).
_CHOICE_AT_START = re.compile(r"^\s*(?:\(([A-Za-z])\)|([A-Z])(?=[.,):;!]|\s*$)|([a-z])(?=[.):]|\s*$))")
_CHOICE_IN_PARENS = re.compile(r"\(([A-Z])\)")
# A capital standing alone, but not "A" or "I" before a word ("A cat", "I think"): an article or a pronoun.
_CHOICE_ALONE = re.compile(r"(?<![\w'])([A-Z])(?![\w'])(?!(?<=[AI])\s+[a-z])")
# How a prompt offers its options: a line opening with "A." "A)" "(A)" or "A:"
_OPTION_LINE = re.compile(r"^\s*\(?([A-Z])[.):]\s", re.MULTILINE)
_EMPHASIS = re.compile(r"[*_`]+")


def normalize(text: str) -> str:
    """SQuAD's answer normalization, after Unicode NFKC: lowercase, punctuation removed, articles removed,
    whitespace collapsed."""
    text = _DECIMAL_POINT.sub(_KEPT_POINT, unicodedata.normalize("NFKC", text).lower())
    text = "".join(ch for ch in text if ch not in _PUNCTUATION and not unicodedata.category(ch).startswith("P"))
    return " ".join(_ARTICLES.sub(" ", text).split()).replace(_KEPT_POINT, ".")


def final_number(text: str) -> Decimal | None:
    """The number a text ends on: after "####" (GSM8K's answers), else the first after the last "answer is" /
    "answer:" (the last after it where that one opens a sum), else the last one in the text; None if it has none."""
    text = unicodedata.normalize("NFKC", text).translate(_MINUS)
    found = _GSM8K_FINAL.search(text)
    if found and _NUMBER.search(found.group(1)):
        return _decimal(_NUMBER.search(found.group(1)).group(0))
    answers = list(_ANSWER_IS.finditer(text))
    if answers:
        tail = answers[-1].group(1)
        numbers = list(_NUMBER.finditer(tail))
        if numbers:
            first = numbers[0]
            return _decimal((numbers[-1] if _SUM_AFTER.match(tail, first.end()) else first).group(0))
    numbers = _NUMBER.findall(text)
    return _decimal(numbers[-1]) if numbers else None


def _decimal(token: str) -> Decimal | None:
    try:
        return Decimal(token.replace(",", "").replace("$", ""))
    except InvalidOperation:
        return None


def offered_letters(prompt: str) -> frozenset[str] | None:
    """The option letters a prompt offers on lines of their own ("A. ...", "(B) ...", "C) ..."), if two or more."""
    letters = frozenset(_OPTION_LINE.findall(unicodedata.normalize("NFKC", prompt)))
    return letters if len(letters) >= 2 else None


def choice_letter(text: str, offered: frozenset[str] | None = None) -> str | None:
    """The multiple-choice letter a text gives, upper case, of the `offered` ones (None: any): after "answer",
    else after "option"/"choice", else one opening the text ("B", "(B)", "B.", "B,", "**B**", "b" but not the article
    of "A cat"), else the first in parentheses, else (with `offered` known) the first offered capital standing alone;
    None if none."""
    text = _EMPHASIS.sub("", unicodedata.normalize("NFKC", text)).strip()
    patterns = [_CHOICE_AFTER_ANSWER, _CHOICE_AFTER_OPTION, _CHOICE_AT_START, _CHOICE_IN_PARENS]
    for pattern in patterns + ([_CHOICE_ALONE] if offered else []):
        for found in pattern.finditer(text):
            letter = next(group for group in found.groups() if group).upper()
            if offered is None or letter in offered:
                return letter
    return None


def exact_match(generation: str, expected: str, pattern: re.Pattern | None = None, prompt: str = "") -> float:
    return float(normalize(generation) == normalize(expected))


def contains(generation: str, expected: str, pattern: re.Pattern | None = None, prompt: str = "") -> float:
    return float(f" {normalize(expected)} " in f" {normalize(generation)} ")


def regex(generation: str, expected: str, pattern: re.Pattern | None = None, prompt: str = "") -> float:
    if pattern is None:
        raise ValueError("the regex scorer needs eval.answer_pattern")
    found = pattern.search(generation)
    if found is None:
        return 0.0
    answer = next((g for g in found.groups() if g is not None), None) if pattern.groups else found.group(0)
    return float(answer is not None and normalize(answer) == normalize(expected))


def choice(generation: str, expected: str, pattern: re.Pattern | None = None, prompt: str = "") -> float:
    return float(choice_letter(generation, offered_letters(prompt)) == expected_choice(expected))


def number(generation: str, expected: str, pattern: re.Pattern | None = None, prompt: str = "") -> float:
    got, want = final_number(generation), final_number(expected)
    return float(got is not None and want is not None and got == want)


def expected_choice(expected: str) -> str | None:
    """The letter an expected answer names: "B", "b", "(B)", "B." or "The answer is B"."""
    letter = choice_letter(expected)
    return letter if letter else (expected.strip().upper() if re.fullmatch(r"[A-Za-z]", expected.strip()) else None)


SCORERS: dict[str, Callable[[str, str, re.Pattern | None, str], float]] = {
    "exact_match": exact_match, "contains": contains, "regex": regex, "choice": choice, "number": number}


def check_expected(expected: str, scorers: list[str]) -> str | None:
    """Why no generation could ever score on `expected` under one of `scorers` (None when every one can)."""
    if "number" in scorers and final_number(expected) is None:
        return f"the expected answer {expected!r} has no number (scorer number)"
    if "choice" in scorers and expected_choice(expected) is None:
        return f"the expected answer {expected!r} names no choice letter A-Z (scorer choice)"
    if {"exact_match", "contains", "regex"} & set(scorers) and not normalize(expected):
        return f"the expected answer {expected!r} is empty after normalization (punctuation and articles removed)"
    return None


def score(generation: str, expected: str, scorers: list[str], pattern: re.Pattern | None = None,
          prompt: str = "") -> dict[str, float]:
    """{scorer: 1.0 or 0.0} for each of `scorers`; `prompt` (the last user message) says which choices it offers."""
    return {name: SCORERS[name](generation, expected, pattern, prompt) for name in scorers}


def standard_error(values: list[float]) -> float:
    """The standard error of the mean of `values` (the sample standard deviation over the root of their count, as
    lm-evaluation-harness reports it); 0 for fewer than two."""
    n = len(values)
    if n < 2:
        return 0.0
    mean = sum(values) / n
    return (sum((v - mean) ** 2 for v in values) / (n - 1) / n) ** 0.5
