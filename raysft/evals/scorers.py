"""Scoring a generation against its expected answer, by scorers chosen by name (eval.scorers).

Each scorer is a plain function of (generation, expected) -> 1.0 or 0.0; none runs code from the data or the
config (eval.answer_pattern is a regular expression, matched, never evaluated). What each one compares:

  exact_match  the two texts equal after normalization (SQuAD's: lowercase, punctuation removed, no articles a/an/the,
               whitespace collapsed; Unicode NFKC first, so full-width digits and ligatures compare as their plain
               forms)
  contains     the normalized expected answer occurs in the normalized generation as whole words ("4" is not in
               "14")
  regex        eval.answer_pattern's first match in the generation (its first group, if it has one; else the whole
               match), normalized, equals the normalized expected answer; no match scores 0
  choice       the multiple-choice letter the generation gives ("B", "(B)", "B)", "The answer is B") equals the
               expected letter
  number       the final number of the generation (after GSM8K's "####" if it writes one, else after "answer is",
               else its last number) equals the expected answer's, as decimals: "1,234" is 1234, "42.0" is 42,
               "$5" is 5

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
# A number not glued to a word before it ("x2" is no number; "5-3" is 5 and 3): digits with thousands commas, an
# optional fraction, an optional sign and currency sign.
_NUMBER = re.compile(r"(?<![\w.])-?\$?\d[\d,]*(?:\.\d+)?|(?<![\w.])-?\$?\.\d+")
_GSM8K_FINAL = re.compile(r"####\s*(.*)")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*(.*)", re.IGNORECASE | re.DOTALL)
# The letter is a capital (the article of "answer is a cat" is none); "answer" in any case.
_CHOICE_AFTER_ANSWER = re.compile(r"(?i:answer)\s*(?:(?i:is)|:)?\s*\(?([A-Z])\)?(?!\w)")
_CHOICE_AT_START = re.compile(r"^\s*(?:\(([A-Z])\)|([A-Z])(?:[.):]|\s*$))")
_CHOICE_IN_PARENS = re.compile(r"\(([A-Z])\)")


def normalize(text: str) -> str:
    """SQuAD's answer normalization, after Unicode NFKC: lowercase, punctuation removed, articles removed,
    whitespace collapsed."""
    text = unicodedata.normalize("NFKC", text).lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION and not unicodedata.category(ch).startswith("P"))
    return " ".join(_ARTICLES.sub(" ", text).split())


def final_number(text: str) -> Decimal | None:
    """The number a text ends on: after "####" (GSM8K's answers), else the first after "answer is"/"answer:",
    else the last one in the text; None if it has none."""
    text = unicodedata.normalize("NFKC", text)
    for pattern, pick in ((_GSM8K_FINAL, 0), (_ANSWER_IS, 0)):
        found = pattern.search(text)
        if found:
            numbers = _NUMBER.findall(found.group(1))
            if numbers:
                return _decimal(numbers[pick])
    numbers = _NUMBER.findall(text)
    return _decimal(numbers[-1]) if numbers else None


def _decimal(token: str) -> Decimal | None:
    try:
        return Decimal(token.replace(",", "").replace("$", ""))
    except InvalidOperation:
        return None


def choice_letter(text: str) -> str | None:
    """The multiple-choice letter a text gives, upper case: after "answer is", else one opening the text ("B",
    "(B)", "B.", "B)", "B:" but not the article of "A cat"), else the first in parentheses; None if none."""
    text = unicodedata.normalize("NFKC", text).strip()
    for pattern in (_CHOICE_AFTER_ANSWER, _CHOICE_AT_START, _CHOICE_IN_PARENS):
        found = pattern.search(text)
        if found:
            return next(group for group in found.groups() if group)
    return None


def exact_match(generation: str, expected: str, pattern: re.Pattern | None = None) -> float:
    return float(normalize(generation) == normalize(expected))


def contains(generation: str, expected: str, pattern: re.Pattern | None = None) -> float:
    return float(f" {normalize(expected)} " in f" {normalize(generation)} ")


def regex(generation: str, expected: str, pattern: re.Pattern | None = None) -> float:
    if pattern is None:
        raise ValueError("the regex scorer needs eval.answer_pattern")
    found = pattern.search(generation)
    if found is None:
        return 0.0
    answer = found.group(1) if pattern.groups else found.group(0)
    return float(answer is not None and normalize(answer) == normalize(expected))


def choice(generation: str, expected: str, pattern: re.Pattern | None = None) -> float:
    return float(choice_letter(generation) == expected_choice(expected))


def number(generation: str, expected: str, pattern: re.Pattern | None = None) -> float:
    got, want = final_number(generation), final_number(expected)
    return float(got is not None and want is not None and got == want)


def expected_choice(expected: str) -> str | None:
    """The letter an expected answer names: "B", "b", "(B)", "B." or "The answer is B"."""
    letter = choice_letter(expected)
    return letter if letter else (expected.strip().upper() if re.fullmatch(r"[A-Za-z]", expected.strip()) else None)


SCORERS: dict[str, Callable[[str, str, re.Pattern | None], float]] = {
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


def score(generation: str, expected: str, scorers: list[str], pattern: re.Pattern | None = None) -> dict[str, float]:
    """{scorer: 1.0 or 0.0} for each of `scorers`."""
    return {name: SCORERS[name](generation, expected, pattern) for name in scorers}
