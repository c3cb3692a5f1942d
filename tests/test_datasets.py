"""Prompt data from files: loaders on real rows, malformed rows, shuffling/splitting, templates, length limits.

Unit tier: no Ray, no vLLM. Tests on real rows read ``../shared/data`` and skip, saying so, without it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from mugrpo_async.config import ConfigError, load_config
from mugrpo_async.data.loaders import DatasetError, MathRow, detect_format, load_rows, shuffle_split
from mugrpo_async.data.pool import load_prompts, synthetic_prompts
from mugrpo_async.data.prompts import INSTRUCTION, render_prompt, resolve_template, tokenize_prompts

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason=f"real data sets not found at {DATA}")

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture()
def chat_tokenizer(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# ---- real rows --------------------------------------------------------------------------------------------


@needs_data
def test_math500_rows():
    rows, skipped = load_rows(DATA / "math500" / "test.jsonl", "math")
    assert (len(rows), skipped) == (500, 0)
    assert rows[0].answer == "\\left( 3, \\frac{\\pi}{2} \\right)" and rows[0].problem.startswith("Convert the point")
    assert rows[4].answer == "\\text{Evelyn}" and rows[162].answer == "\\dfrac{17}{50}"
    assert rows[0].id == "math500/test:0" and len({r.id for r in rows}) == 500
    assert rows[0].meta == {"source": "math500/test", "index": 0, "unique_id": "test/precalculus/807.json",
                            "level": 2, "subject": "Precalculus"}  # fmt: skip
    assert load_rows(DATA / "math500" / "test.jsonl")[0] == rows  # auto -> math


@needs_data
def test_gsm8k_rows_take_the_number_after_hashes():
    path = DATA / "gsm8k" / "test.jsonl"
    rows, _ = load_rows(path, "gsm8k")
    assert len(rows) == 1319
    assert rows[0].answer == "18" and rows[0].problem.startswith("Janet")
    assert rows[146].answer == "2125"  # line 147 ends with "#### 2,125"
    assert rows[489].answer == "-10"
    assert load_rows(path)[0] == rows  # auto-detected from the first row's keys


@needs_data
def test_aime_and_amc_numeric_answers():
    aime24, _ = load_rows(DATA / "aime24" / "test.jsonl", "aime")
    assert [r.answer for r in aime24[:8]] == ["204", "113", "371", "385", "110", "104", "721", "25"]  # "025"
    aime25, _ = load_rows(DATA / "aime25" / "test.jsonl", "aime")
    assert [r.answer for r in aime25[:3]] == ["70", "588", "16"]  # JSON integers
    amc23, _ = load_rows(DATA / "amc23" / "test.jsonl", "amc")
    assert len(amc23) == 40
    assert [r.answer for r in amc23[:4]] == ["27", "36", "45", "3159"]  # JSON floats 27.0, ...
    assert amc23[15].answer == "-1"  # -1.0
    assert all("." not in r.answer for r in amc23)


@needs_data
def test_deepscaler_json_lists_with_real_bad_rows():
    path = DATA / "deepscaler" / "train_math.json"
    with pytest.raises(DatasetError, match=r"train_math\.json, row 886: field 'answer' is null"):
        load_rows(path)
    math, skipped = load_rows(path, on_bad_row="skip")  # rows 886, 1009 (null) and 5328, 5330 (empty)
    assert (len(math), skipped) == (7470, 4)
    assert math[0].answer == "0" and math[0].meta["type"] == "Algebra"
    assert [r.meta["index"] for r in math[885:887]] == [885, 887]
    aime, _ = load_rows(DATA / "deepscaler" / "train_aime.json", "aime")
    assert aime[0].answer == "60" and aime[0].meta["year"] == 1983


def test_detect_format():
    assert detect_format({"question": "q", "answer": "x\n#### 3"}) == "gsm8k"
    assert detect_format({"problem": "p", "answer": "3"}) == "math"
    assert detect_format({"problem": "p", "question": "p", "answer": 27.0}) == "math"


# ---- malformed rows ---------------------------------------------------------------------------------------


GOOD = {"problem": "What is 1+1?", "answer": "2"}


@pytest.mark.parametrize(
    ("bad", "fmt", "reason"),
    [
        ({"problem": "What is 2+2?"}, "math", "missing field 'answer'"),
        ({"answer": "4"}, "math", "missing field 'problem'"),
        ({"problem": "   ", "answer": "4"}, "math", "empty or non-text problem"),
        ({"problem": 7, "answer": "4"}, "math", "empty or non-text problem"),
        ({"problem": "p", "answer": ""}, "math", "unparsable answer"),
        ({"problem": "p", "answer": None}, "math", "field 'answer' is null"),
        ({"problem": "p", "answer": [1, 2]}, "math", "unparsable answer"),
        ({"problem": "p", "answer": "twelve"}, "aime", "unparsable answer"),
        ({"problem": "p", "answer": True}, "amc", "unparsable answer"),
        ({"problem": "p", "answer": float("nan")}, "amc", "unparsable answer"),
        ({"question": "q", "answer": "no hashes here"}, "gsm8k", "unparsable answer"),
        ({"question": "q", "answer": "so #### many"}, "gsm8k", "unparsable answer"),
        ('{"problem": "p", "answer": ', "math", "bad JSON"),
        ("[1, 2]", "math", "expected an object"),
    ],
)
def test_bad_jsonl_row_names_file_and_line(tmp_path, bad, fmt, reason):
    good = GOOD if fmt != "gsm8k" else {"question": "q", "answer": "#### 2"}
    path = _write_jsonl(tmp_path / "d.jsonl", [good, "", good, bad, good])  # the blank line 2 is no row
    with pytest.raises(DatasetError) as err:
        load_rows(path, fmt)
    assert str(err.value).startswith(f"{path}, line 4: ") and reason in str(err.value)

    rows, skipped = load_rows(path, fmt, on_bad_row="skip")
    assert (len(rows), skipped) == (3, 1)
    assert [r.meta["index"] for r in rows] == [0, 1, 3]  # record positions; ids stay stable


def test_skips_are_counted_and_logged(tmp_path, caplog):
    path = _write_jsonl(tmp_path / "d.jsonl", [GOOD, {"problem": "x"}, "not json", GOOD, {"answer": "1"}])
    with caplog.at_level(logging.WARNING, logger="mugrpo_async.data.loaders"):
        rows, skipped = load_rows(path, on_bad_row="skip")
    assert (len(rows), skipped) == (2, 3)
    messages = [r.getMessage() for r in caplog.records]
    assert any("line 2: skipped" in m for m in messages) and any("line 3: skipped" in m for m in messages)
    assert any("skipped 3 malformed rows of 5" in m for m in messages)


def test_bad_json_list_row_names_its_index(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([GOOD, GOOD, {"problem": "p", "answer": "  "}, "x"], indent=2))
    with pytest.raises(DatasetError, match=r"d\.json, row 2: unparsable answer"):
        load_rows(path)
    rows, skipped = load_rows(path, on_bad_row="skip")
    assert (len(rows), skipped) == (2, 2)


def test_broken_files(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text('[\n  {"problem": "p", "answer": "1"},\n  {"problem": "p" "answer": "2"}\n]')
    for mode in ("error", "skip"):  # a list that does not parse has no rows to skip
        with pytest.raises(DatasetError, match=r"broken\.json, line 3: bad JSON"):
            load_rows(broken, on_bad_row=mode)
    (tmp_path / "obj.json").write_text('{"problem": "p", "answer": "1"}')  # not a list: read as JSONL
    assert load_rows(tmp_path / "obj.json")[0][0].answer == "1"
    (tmp_path / "num.json").write_text("[1, 2]")
    with pytest.raises(DatasetError, match="row 0: expected an object"):
        load_rows(tmp_path / "num.json")
    with pytest.raises(DatasetError, match="no such data file"):
        load_rows(tmp_path / "missing.jsonl")
    (tmp_path / "d.csv").write_text("problem,answer\n")
    with pytest.raises(DatasetError, match="unknown data file type '.csv'"):
        load_rows(tmp_path / "d.csv")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DatasetError, match="no valid row"):
        load_rows(tmp_path / "empty.jsonl")
    with pytest.raises(DatasetError, match="unknown data format 'csv'"):
        load_rows(tmp_path / "empty.jsonl", "csv")


def test_parquet(tmp_path):
    path = tmp_path / "d.parquet"
    import pyarrow as pa  # a dependency of the project
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([GOOD, {"problem": "", "answer": "3"}]), path)
    with pytest.raises(DatasetError, match=r"d\.parquet, row 1: empty or non-text problem"):
        load_rows(path)
    assert load_rows(path, on_bad_row="skip")[1] == 1


def test_custom_keys_and_overrides(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Add 2 and 3.", "target": 5.0, "level": 1}])
    rows, _ = load_rows(path, "custom", problem_key="prompt", answer_key="target")
    assert rows == [MathRow(f"{tmp_path.name}/d:0", "Add 2 and 3.", "5", {"source": f"{tmp_path.name}/d", "index": 0,
                                                                           "level": 1})]  # fmt: skip
    with pytest.raises(DatasetError, match="problem_key and answer_key"):
        load_rows(path, "custom")
    rows, _ = load_rows(path, "amc", problem_key="prompt", answer_key="target")  # a format with other keys
    assert rows[0].answer == "5"


# ---- shuffling and splitting ------------------------------------------------------------------------------


def _rows(n: int) -> list[MathRow]:
    return [MathRow(f"s:{i}", f"p{i}", str(i)) for i in range(n)]


def test_shuffle_split_is_deterministic_and_disjoint():
    rows = _rows(50)
    train, held = shuffle_split(rows, seed=3, heldout=10)
    assert (train, held) == shuffle_split(rows, seed=3, heldout=10)
    assert len(train) == 40 and len(held) == 10
    assert sorted(r.id for r in train + held) == sorted(r.id for r in rows)
    assert shuffle_split(rows, seed=4, heldout=10)[1] != held
    assert shuffle_split(rows, seed=3, heldout=20)[1][:10] == held  # a larger held-out set only grows
    assert shuffle_split(rows, seed=None, heldout=5) == (rows[5:], rows[:5])
    assert rows == _rows(50)  # input untouched
    with pytest.raises(ValueError, match="heldout"):
        shuffle_split(rows, seed=0, heldout=50)


# ---- templates and lengths --------------------------------------------------------------------------------


def test_templates_plain_and_chat(tokenizer, chat_tokenizer):
    assert resolve_template("auto", tokenizer) == "plain"
    assert resolve_template("auto", chat_tokenizer) == "chat"
    with pytest.raises(ValueError, match="no chat_template"):
        resolve_template("chat", tokenizer)
    with pytest.raises(ValueError, match="unknown prompt template"):
        resolve_template("fancy", tokenizer)
    plain = render_prompt("What is 1+1?", tokenizer, "plain")
    assert plain == f"Problem: What is 1+1?\n{INSTRUCTION}\nSolution:" and "\\boxed{}" in INSTRUCTION
    chat = render_prompt("What is 1+1?", chat_tokenizer, "chat")
    assert chat == f"<|user|>What is 1+1? {INSTRUCTION}\n<|assistant|>"
    assert render_prompt("What is 1+1?", tokenizer, "none") == "What is 1+1?"


def test_too_long_prompts_are_dropped_and_counted_never_cut(tokenizer, chat_tokenizer):
    rows = [MathRow(f"s:{i}", "x" * (10 * i + 1), "1", {"index": i}) for i in range(10)]
    for tok, template in ((tokenizer, "none"), (tokenizer, "plain"), (chat_tokenizer, "auto")):
        texts = [render_prompt(r.problem, tok, resolve_template(template, tok)) for r in rows]
        full = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
        limit = len(full[5])
        prompts, dropped = tokenize_prompts(rows, tok, template, limit)
        assert len(prompts) == 6 and dropped == 4
        assert [p["prompt_ids"] for p in prompts] == full[:6]  # whole prompts, in row order
        assert all(p["meta"]["prompt_tokens"] == len(p["prompt_ids"]) <= limit for p in prompts)
        assert set(prompts[0]) == {"prompt_id", "prompt_ids", "answer", "meta"}
    assert tokenize_prompts([], tokenizer, "plain", 8) == ([], 0)


# ---- load_prompts -----------------------------------------------------------------------------------------


def test_load_prompts_synthetic_is_unchanged(tokenizer):
    cfg = load_config(None, ["data.num_problems=40"])
    assert load_prompts(cfg, tokenizer) == synthetic_prompts(cfg, tokenizer)
    heldout, _ = load_prompts(cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"num_problems": 12})}),
                              tokenizer, split="heldout")  # fmt: skip
    assert len(heldout) == 12 and not {p["prompt_id"] for p in heldout} & {
        p["prompt_id"] for p in load_prompts(cfg, tokenizer)[0]
    }  # a draw of its own, disjoint from the training pool


def test_load_prompts_from_file(tmp_path, tokenizer):
    padding = " Think about it." * 6  # makes every third prompt longer than 120 tokens
    rows = [{"problem": f"What is {i} + {i}?" + (padding if i % 3 == 0 else ""), "answer": 2 * i} for i in range(30)]
    path = _write_jsonl(tmp_path / "train.jsonl", rows)
    over = ["data.source=file", f"data.path={path}", "data.max_prompt_tokens=120", "data.heldout_problems=5"]
    cfg = load_config(None, over)
    train, dropped = load_prompts(cfg, tokenizer)
    held, held_dropped = load_prompts(cfg, tokenizer, split="heldout")
    assert len(train) + dropped == 25 and len(held) + held_dropped == 5 and dropped > 0
    assert not {p["prompt_id"] for p in train} & {p["prompt_id"] for p in held}
    assert all(p["answer"] == str(2 * p["meta"]["index"]) for p in train + held)
    assert load_prompts(cfg, tokenizer) == (train, dropped)  # deterministic
    assert load_prompts(load_config(None, over + ["data.shuffle_seed=1"]), tokenizer)[0] != train
    limited, limited_dropped = load_prompts(load_config(None, over + ["data.limit=10"]), tokenizer)
    assert len(limited) + limited_dropped == 10
    with pytest.raises(ValueError, match="fits data.max_prompt_tokens"):
        load_prompts(load_config(None, over + ["data.max_prompt_tokens=5"]), tokenizer)


def test_load_prompts_bad_row_is_an_error_naming_file_and_line(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "train.jsonl", [GOOD, {"problem": "p"}])
    over = ["data.source=file", f"data.path={path}", "data.max_prompt_tokens=200"]
    with pytest.raises(DatasetError, match=r"train\.jsonl, line 2: missing field 'answer'"):
        load_prompts(load_config(None, over), tokenizer)
    prompts, _ = load_prompts(load_config(None, over + ["data.on_bad_row=skip"]), tokenizer)
    assert len(prompts) == 1


@pytest.mark.parametrize(
    ("override", "key"),
    [
        (["data.source=file"], "data.path"),
        (["data.source=web"], "data.source"),
        (["data.template=chat"], "data.template"),
        (["data.source=file", "data.path=x.jsonl", "data.format=custom"], "data.problem_key"),
        (["data.format=csv"], "data.format"),
        (["data.on_bad_row=ignore"], "data.on_bad_row"),
        (["data.limit=-1"], "data.limit"),
    ],
)
def test_data_config_errors_name_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, override)
    assert key in str(err.value)


def test_data_config_defaults_keep_the_synthetic_task():
    d = load_config(None).data
    assert (d.source, d.path, d.format, d.template, d.on_bad_row) == ("synthetic", None, "auto", "auto", "error")
    assert load_config(None, ["data.template=none"]).data.template == "none"
