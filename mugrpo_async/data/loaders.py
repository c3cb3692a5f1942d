"""Math prompt data from files: JSONL, JSON lists and Parquet, in the formats of the common sets.

A file becomes a list of :class:`MathRow` (problem text, normalised reference answer, small meta).
Built-in formats (``data.format``):

- ``math``: DeepScaleR / MATH style, fields ``problem`` and ``answer`` (any non-empty answer; numbers
  are written in their shortest integer form, ``27.0 -> "27"``).
- ``gsm8k``: fields ``question`` and ``answer``; the reference is the number after the last ``####``,
  commas removed (``"#### 1,000" -> "1000"``).
- ``aime`` / ``amc``: fields ``problem`` and ``answer``; the answer must be a number (``27.0``, ``"025"``,
  ``70``), normalised the same way (``"27"``, ``"25"``, ``"70"``).
- ``custom``: only the given ``problem_key`` / ``answer_key``, answers as in ``math``.
- ``auto``: ``gsm8k`` when the first row has ``question`` but no ``problem`` and a ``####`` answer,
  else ``math``.

A malformed row (missing field, empty problem, unparsable answer, bad JSON line) is a
:class:`DatasetError` naming the file and the row: ``line N`` (1-based) for JSONL, ``row I``
(0-based index) for JSON lists and Parquet. With ``on_bad_row="skip"`` it is dropped, logged and
counted instead. A JSON list file that does not parse as a whole is always an error.

Example::

    rows, skipped = load_rows("../shared/data/gsm8k/test.jsonl", fmt="gsm8k")
    train, heldout = shuffle_split(rows, seed=0, heldout=100)
"""

from __future__ import annotations

import json
import logging
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mugrpo_async.choices import DATA_FORMATS

log = logging.getLogger(__name__)

META_KEYS = ("id", "unique_id", "level", "subject", "type", "difficulty", "year")
"""Scalar fields copied from a row into :attr:`MathRow.meta` when present."""


class DatasetError(ValueError):
    """A data file that cannot be read, or a malformed row; the message names file and row."""


@dataclass(frozen=True)
class MathRow:
    """One problem with its reference answer.

    Attributes:
        id: ``f"{source}:{index}"``, ``index`` the 0-based position among the file's records (blank
            JSONL lines do not count); unique within a file and stable across loads.
        problem: Problem text, stripped, non-empty.
        answer: Reference answer, stripped, non-empty (numbers normalised, see the module docstring).
        meta: Small msgpack-friendly scalars: ``source``, ``index`` and any of :data:`META_KEYS`.
    """

    id: str
    problem: str
    answer: str
    meta: dict[str, Any] = field(default_factory=dict)


def _number_text(value: Any) -> str:
    """Shortest exact text of a number: ``27.0 -> "27"``, ``"025" -> "25"``, ``"1,000" -> "1000"``.

    Raises:
        ValueError: for booleans, non-finite values and anything that is not a number.
    """
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"not a number: {value!r}")
    if isinstance(value, str):
        text = value.strip().replace(",", "")
        try:
            return str(int(text))
        except ValueError:
            value = float(text)  # raises ValueError("could not convert ...") for non-numbers
    if isinstance(value, int):
        return str(value)
    if not math.isfinite(value):
        raise ValueError(f"not a finite number: {value!r}")
    return str(int(value)) if value.is_integer() else repr(value)


def _text_answer(value: Any) -> str:
    """Any non-empty answer: numbers as in :func:`_number_text`, strings stripped."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return _number_text(value)
    if not isinstance(value, str):
        raise ValueError(f"answer must be a string or a number, got {type(value).__name__}")
    if not value.strip():
        raise ValueError("empty answer")
    return value.strip()


def _gsm8k_answer(value: Any) -> str:
    """The number after the last ``####`` of a GSM8K rationale, commas removed."""
    if not isinstance(value, str) or "####" not in value:
        raise ValueError("answer has no `#### <number>` line")
    return _number_text(value.rsplit("####", 1)[1])


@dataclass(frozen=True)
class RowFormat:
    """Where a format finds the problem and the answer, and how it normalises the answer."""

    problem_key: str | None
    answer_key: str | None
    parse_answer: Callable[[Any], str]


FORMATS: dict[str, RowFormat] = {
    "math": RowFormat("problem", "answer", _text_answer),
    "gsm8k": RowFormat("question", "answer", _gsm8k_answer),
    "aime": RowFormat("problem", "answer", _number_text),
    "amc": RowFormat("problem", "answer", _number_text),
    "custom": RowFormat(None, None, _text_answer),
}
"""Built-in row formats by ``data.format`` name (``auto`` resolves to one of them)."""
assert tuple(FORMATS) == DATA_FORMATS, "FORMATS must cover mugrpo_async.choices.DATA_FORMATS exactly"


def detect_format(record: dict) -> str:
    """``gsm8k`` for a GSM8K-style record (``question``, no ``problem``, ``####`` answer), else ``math``."""
    answer = record.get("answer")
    if "question" in record and "problem" not in record and isinstance(answer, str) and "####" in answer:
        return "gsm8k"
    return "math"


def _jsonl_records(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield f"line {lineno}", json.loads(line)
            except json.JSONDecodeError as err:
                yield f"line {lineno}", DatasetError(f"bad JSON ({err.msg} at column {err.colno})")


def _json_list_records(path: Path, text: str) -> Iterator[tuple[str, Any]]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise DatasetError(f"{path}, line {err.lineno}: bad JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(data, list):
        raise DatasetError(f"{path}: a .json file must hold a list of objects, got {type(data).__name__}")
    for index, record in enumerate(data):
        yield f"row {index}", record


def _parquet_records(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(f"{path}: reading Parquet needs the `pyarrow` package (pip install pyarrow)") from None
    for index, record in enumerate(pq.read_table(path).to_pylist()):
        yield f"row {index}", record


def read_file_records(path: str | Path) -> Iterator[tuple[str, Any]]:
    """Yields ``(location, record)`` per record of a data file, in file order.

    ``location`` is ``"line N"`` (JSONL, 1-based) or ``"row I"`` (JSON list / Parquet, 0-based). A
    JSONL line that is not valid JSON yields a :class:`DatasetError` as its record (the caller decides
    whether to raise or skip). A ``.json`` file whose text does not start with ``[`` is read as JSONL.

    Raises:
        DatasetError: for a missing file, an unknown suffix, a JSON list file that does not parse, or
            Parquet without pyarrow.
    """
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: no such data file")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return _parquet_records(path)
    if suffix == ".jsonl":
        return _jsonl_records(path)
    if suffix == ".json":
        text = path.read_text(encoding="utf-8")
        return _json_list_records(path, text) if text.lstrip().startswith("[") else _jsonl_records(path)
    raise DatasetError(f"{path}: unknown data file type {suffix!r}; use .jsonl, .json (a list) or .parquet")


def _row(record: Any, index: int, source: str, fmt: RowFormat, keys: tuple[str | None, str | None]) -> MathRow:
    """One record as a :class:`MathRow`; ``keys`` override the format's (problem, answer) keys.

    Raises:
        ValueError: with the reason (the caller adds file and row).
    """
    if isinstance(record, Exception):
        raise record
    if not isinstance(record, dict):
        raise ValueError(f"expected an object, got {type(record).__name__}")
    problem_key, answer_key = keys[0] or fmt.problem_key, keys[1] or fmt.answer_key
    for key in (problem_key, answer_key):
        if key not in record:
            raise ValueError(f"missing field {key!r} (row has: {', '.join(map(str, record)) or 'nothing'})")
        if record[key] is None:
            raise ValueError(f"field {key!r} is null")
    problem = record[problem_key]
    if not isinstance(problem, str) or not problem.strip():
        raise ValueError(f"empty or non-text problem in field {problem_key!r}")
    try:
        answer = fmt.parse_answer(record[answer_key])
    except ValueError as err:
        raise ValueError(f"unparsable answer {record[answer_key]!r:.80} in field {answer_key!r} ({err})") from None
    meta = {"source": source, "index": index}
    meta.update({k: record[k] for k in META_KEYS if isinstance(record.get(k), str | int | float | bool)})
    return MathRow(id=f"{source}:{index}", problem=problem.strip(), answer=answer, meta=meta)


def load_rows(
    path: str | Path,
    fmt: str = "auto",
    problem_key: str | None = None,
    answer_key: str | None = None,
    on_bad_row: str = "error",
    source: str | None = None,
    max_rows: int = 0,
) -> tuple[list[MathRow], int]:
    """Reads a data file into rows; returns ``(rows, number of malformed rows skipped)``.

    Args:
        path: A ``.jsonl``, ``.json`` (list of objects) or ``.parquet`` file.
        fmt: A key of :data:`FORMATS`, or ``"auto"`` (decided by the first record, see
            :func:`detect_format`).
        problem_key, answer_key: Field names overriding the format's (required for ``custom``).
        on_bad_row: ``"error"``: a malformed row raises; ``"skip"``: it is logged, dropped and counted.
        source: Prefix of the row ids (default: ``"<folder>/<file stem>"``, e.g. ``"math500/test"``).
        max_rows: Read only the file's first this many records (0: all), e.g. to check a file quickly.

    Returns:
        The rows in file order (ids ``f"{source}:{index}"``) and the count of skipped rows.

    Raises:
        DatasetError: naming the file and the row, for a malformed row under ``"error"``; also for an
            unreadable file, an unknown format, and a file with no valid row.
    """
    path = Path(path)
    if fmt != "auto" and fmt not in FORMATS:
        raise DatasetError(f"unknown data format {fmt!r}; valid: auto, {', '.join(FORMATS)}")
    if fmt == "custom" and not (problem_key and answer_key):
        raise DatasetError("data format `custom` needs problem_key and answer_key")
    source = source or f"{path.parent.name}/{path.stem}"
    rows: list[MathRow] = []
    skipped = 0
    for index, (where, record) in enumerate(read_file_records(path)):
        if max_rows and index >= max_rows:
            break
        if fmt == "auto" and isinstance(record, dict):
            fmt = detect_format(record)
            log.info("%s: detected format %s", path, fmt)
        try:
            rows.append(_row(record, index, source, FORMATS.get(fmt, FORMATS["math"]), (problem_key, answer_key)))
        except ValueError as err:
            if on_bad_row != "skip":
                raise DatasetError(f"{path}, {where}: {err}") from None
            log.warning("%s, %s: skipped (%s)", path, where, err)
            skipped += 1
    if skipped:
        log.warning("%s: skipped %d malformed rows of %d", path, skipped, skipped + len(rows))
    if not rows:
        raise DatasetError(f"{path}: no valid row")
    return rows, skipped


def shuffle_split(rows: list[MathRow], seed: int | None, heldout: int = 0) -> tuple[list[MathRow], list[MathRow]]:
    """Seeded permutation of ``rows`` split into ``(train, heldout)``; the inputs are not modified.

    The held-out part is the first ``heldout`` rows of the permutation, so it depends only on the
    rows and the seed: the same ``(rows, seed, heldout)`` always gives the same two lists, and a
    larger ``heldout`` only moves rows from train to held-out. ``seed=None`` keeps file order.

    Raises:
        ValueError: if ``heldout`` is negative or leaves no training row.
    """
    if heldout < 0 or (rows and heldout >= len(rows)):
        raise ValueError(f"heldout must be in [0, {len(rows)}) for {len(rows)} rows, got {heldout}")
    order = list(range(len(rows)))
    if seed is not None:
        random.Random(seed).shuffle(order)
    shuffled = [rows[i] for i in order]
    return shuffled[heldout:], shuffled[:heldout]
