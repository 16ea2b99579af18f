"""Reading a typed answer the way a person means it: a name from a list, or a number, however it was written.

A learner who types ``"fsdp full sharding "``, ``"ZeRO-3"`` or ``Decimal("112256")`` gave the right answer; a
checker that compares strings or types refuses it. Every checker that reads a typed answer goes through here:

- :func:`choice`: one of an exercise's names, matched without regard to case, spacing, ``_`` or ``-``, and through
  the exercise's synonyms (``FULL_SHARD`` and ``ZeRO-3`` for full sharding);
- :func:`number`: any real number (``int``, ``float``, ``Decimal``, ``Fraction``, a NumPy scalar, a one-element
  tensor) or a string of one (``"112,256"``, ``"1.1e5"``, ``"112256 bytes"`` with the unit the exercise asks for).

Each returns the value in the exercise's own terms, or what to say about the answer (a ``str``).

Example::

    choice("zero-3", ("DDP", "FSDP full sharding"), {"zero 3": "FSDP full sharding"}, "a strategy")
    # 'FSDP full sharding'
    number("112,256 bytes", "bytes")   # 112256
"""

from __future__ import annotations

import math
import numbers
import re
import sys
from collections.abc import Mapping, Sequence
from decimal import Decimal
from fractions import Fraction
from typing import Any


def key(text: str) -> str:
    """``text`` as a comparison key: lower case, ``_`` and ``-`` as spaces, one space between words, none before
    a comma, one around a ``+``, no full stop at the end. Example: ``key(" FSDP_full   Sharding +CPU offload")`` is
    ``"fsdp full sharding + cpu offload"``."""
    text = text.casefold().replace("_", " ").replace("-", " ").strip().removesuffix(".")  # a sentence's full stop
    text = re.sub(r"\s*\+\s*", " + ", text)
    text = re.sub(r"\s*,\s*", ", ", text)
    return " ".join(text.split())


def choice(answer: Any, choices: Sequence[str], synonyms: Mapping[str, str] | None = None,
           what: str = "an answer") -> str:
    """The name in ``choices`` that ``answer`` means, or a message (starting "Answer with") when it means none.

    ``synonyms`` maps other names (compared by :func:`key`) to one of ``choices``. A message is recognised by
    ``not in choices``; :func:`chosen` says which.
    """
    if answer is None:
        return f"No answer yet: set `answer` to {what}, one of: {_listed(choices)}."
    if not isinstance(answer, str):
        return f"Answer with {what} as a string, one of: {_listed(choices)} (not {type(answer).__name__})."
    table = {key(name): name for name in choices}
    table |= {key(other): name for other, name in (synonyms or {}).items()}
    found = table.get(key(answer))
    if found is None:
        return f"Answer with {what}, one of: {_listed(choices)}; {quoted(answer.strip(), 60)} is none of them."
    return found


def chosen(result: str, choices: Sequence[str]) -> bool:
    """Whether :func:`choice` returned a name (True) or a message (False)."""
    return result in choices


def _listed(choices: Sequence[str]) -> str:
    return ", ".join(repr(name) for name in choices)


def quoted(text: str, limit: int) -> str:
    """``text`` in quotes, cut to about ``limit`` characters with its closing quote kept: ``'a long ans...'``."""
    return repr(text if len(text) <= limit else text[:limit - 3] + "...")


_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")
#: "pp=4", "answer: 4", "pp 4": the name before a number
_NAMED = re.compile(r"^[A-Za-z_][A-Za-z_0-9]*\s*([=:]\s*|\s(?=\s*[+-]?\.?\d))")
#: Words of a unit as they are shortened or said otherwise (before plurals are read): "1780 s", "1.33x", and a
#: sample of a language model, which is a sequence.
_SAME_WORD = {"s": "seconds", "sec": "seconds", "secs": "seconds", "x": "times", "×": "times",
              "sequence": "sample", "sequences": "samples", "seq": "sample", "seqs": "samples"}


def _unit_words(text: str) -> list[str]:
    """A unit as words, spelled one way: "micro_batches/rank" -> ["micro", "batch", "per", "rank"]."""
    words = re.sub(r"[-_]", " ", text.casefold().replace("/", " per ").replace("×", " × ")).split()
    return [_singular(_SAME_WORD.get(word, word)) for word in words]


def _names_the_unit(text: str, unit: str) -> bool:
    """Whether ``text`` (what follows a number) is ``unit``, its first words or its last word, each singular or
    plural, written with spaces, ``-``, ``_`` or none between its words, ``/`` for "per", or shortened:
    "samples" and "sample/rank" for "samples per rank", "stages" and "-stage" for "pipeline stages",
    "microbatches" for "micro-batches", "s" for "seconds"."""
    said, words = "".join(_unit_words(text)), _unit_words(unit)
    return bool(said) and said in {"".join(words[:count]) for count in range(1, len(words) + 1)} | {words[-1]}


def _singular(word: str) -> str:
    """"micro-batches" -> "micro-batch", "stages" -> "stage", "bytes" -> "byte"."""
    if word.endswith(("ches", "shes", "sses", "xes")):
        return word[:-2]
    return word.removesuffix("s")


def number(answer: Any, unit: str, whole: bool = False) -> float | int | str:
    """``answer`` as an ``int`` (when whole) or a ``float``, or a message saying what was wrong.

    Accepted: any real number (``bool`` aside), a one-element tensor or array, and a string holding one number,
    with ``,`` or ``_`` between thousands, optionally after a name (``"pp=4"``, ``"answer: 4"``) and followed by
    ``unit`` or the start or end of it, singular or plural (``"112,256 bytes"``; ``"3 samples"`` for "samples per
    rank", ``"4 stages"`` for "pipeline stages"); another unit is not read (``"112 MB"``). ``whole``: the
    messages ask for a whole number (the caller checks that it is one).
    """
    kind = ("whole number" if whole else "number") + (f" of {unit}" if unit else "")  # no unit: a bare number
    value = _item(answer)
    if value is None:
        return f"No answer yet: set `answer` to a {kind}."
    if isinstance(value, str):
        text = re.sub(r"(?<=\d)[,_](?=\d{3}\b)", "", _NAMED.sub("", value.strip(), count=1))
        found = _NUMBER.match(text)
        if unit and found and _names_the_unit(text[found.end():], unit):
            text = found.group(0)
        if not _NUMBER.fullmatch(text):
            return f"Answer with a {kind}, not the text {quoted(value.strip(), 40)}."
        digits = text.lstrip("+-").lstrip("0") or "0"
        if any(mark in text for mark in ".eE"):
            value = float(text)
        elif len(digits) > 308:  # past what a float holds (and int() reads past 4,300 digits)
            return _too_large(kind, len(digits) - 1)
        else:
            value = -int(digits) if text.startswith("-") else int(digits)
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, Decimal)):
        return f"Answer with a {kind}, not {type(value).__name__}."
    if isinstance(value, (Decimal, Fraction)) and not (isinstance(value, Decimal) and not value.is_finite()) \
            and abs(value) > sys.float_info.max:
        value = int(value)  # its digits, to say how large it is
    if isinstance(value, numbers.Integral) and abs(int(value)) > sys.float_info.max:
        return _too_large(kind, math.floor(math.log10(abs(int(value)))))
    if isinstance(value, (Decimal, Fraction)):
        value = float(value)
    if not math.isfinite(value):
        return f"Answer with a finite {kind}, not {value!r}."
    return int(value) if float(value).is_integer() else float(value)


def _too_large(kind: str, power: int) -> str:
    return f"Answer with a {kind} that a float can hold (below 1.8e308), not one of about 10^{power}."


def _item(answer: Any) -> Any:
    """A one-element tensor or array as its number; anything else as it is."""
    try:
        return answer.item()
    except (AttributeError, RuntimeError, ValueError, TypeError):
        return answer
