"""Code verdicts (mugrpo_async.rewards.verdicts): stdin/stdout and value tests are judged outside the sandbox,
so no program forges a pass of them; snippet tests run in the program's interpreter. The pure parts are unit
tests; the forging programs run in the real sandbox (a fraction of a second each)."""

from __future__ import annotations

import base64
import json

import pytest

from mugrpo_async.data.code_task import code_row, expression_meta
from mugrpo_async.data.task import Problem
from mugrpo_async.rewards import code
from mugrpo_async.rewards.code import reward
from mugrpo_async.rewards.verdicts import classify, decode, parse_report, passes, same_output, typed, value_test

LIMITS = dict(timeout_s=4.0, cpu_s=2.0, memory_mb=512, nproc=16, file_mb=4)
VALUE = ["assert f(2) == 4", "assert f(5) == 10"]
IO = [{"input": "1 2\n", "output": "3\n"}, {"input": "10 20\n", "output": "30\n"}]
SUM = "print(sum(map(int, input().split())))"


def test_value_tests_are_one_equality_with_a_builtin_literal_on_the_right():
    assert value_test("assert f(2) == 4") == ("f(2)", 4)
    assert value_test("assert g('a', [1]) == {'x': (1, 2.5, None, True)}, 'msg'") == (
        "g('a', [1])",
        {"x": (1, 2.5, None, True)},
    )
    assert value_test("assert answer == -68") == ("answer", -68)
    for other in ("assert f(2) != 4", "assert 4 == f(2)", "assert f(2) == g(2)", "assert f(1) == {1, 2}",
                  "assert f(1) == 1 == 1", "x = 1\nassert x == 1", "assert f(", "check(f)"):  # fmt: skip
        assert value_test(other) is None, other


def test_what_enters_the_sandbox_holds_no_expected_output_nor_literal():
    assert classify({"input": "1 2", "output": "424242"}) == ("io", {"kind": "io", "input": "1 2"})
    assert classify("assert f(2) == 424242") == ("value", {"kind": "value", "expr": "f(2)"})
    assert classify("def check(c):\n    assert c() == 1\ncheck(g)")[0] == "snippet"
    with pytest.raises(ValueError, match="needs string `input` and `output`"):
        classify({"input": "1"})
    with pytest.raises(ValueError, match="not int"):
        classify(3)


def test_typed_values_tell_types_apart_and_refuse_subclasses():
    assert typed([1, (2.0, "a"), {"k": None}]) == typed([1, (2.0, "a"), {"k": None}])
    assert typed(1) != typed(1.0) and typed(1) != typed(True) and typed([1]) != typed((1,))
    assert typed({1: "a", 2: "b"}) == typed({2: "b", 1: "a"})

    class Int(int):
        pass

    with pytest.raises(TypeError, match="not a builtin value: Int"):
        typed(Int(4))


def test_decode_reads_the_tagged_encoding_and_refuses_anything_else():
    tree = ["dict", [[["str", "k"], ["list", [["int", "4"], ["float", "2.5"], ["bool", True], ["none"]]]]]]
    assert decode(tree) == typed({"k": [4, 2.5, True, None]})
    assert decode(["tuple", [["int", "1"]]]) == typed((1,))
    bad = [["int", 4], ["bool", 1], ["object", "x"], ["none", 1], [], "int", ["dict", [[["int", "1"]] * 2] * 2]]
    for tree in bad:
        with pytest.raises(ValueError):
            decode(tree)


def test_outputs_compare_by_whitespace_separated_tokens():
    assert same_output("3", "3\n") and same_output("1 2\n3  ", "1\n2 3") and same_output("", "\n")
    assert not same_output("3.0", "3") and not same_output("1 2", "2 1") and not same_output("12", "1 2")


def _line(token: str, index: int, kind: str, payload: bytes = b"") -> str:
    return f"{token} {index} {kind}" + (" " + base64.b64encode(payload).decode() if payload else "")


def test_report_lines_are_judged_against_what_stayed_outside():
    value = json.dumps(["int", "4"]).encode()
    stdout = "\n".join(["noise", _line("t", 0, "value", value), _line("t", 0, "value", b'["int","5"]'),
                        _line("x", 1, "pass"), _line("t", 1, "ok", b" 3 \n")])  # fmt: skip
    report = parse_report(stdout, "t")
    assert set(report) == {0, 1}  # the first line of each index, the token's only
    assert passes("assert f(2) == 4", "value", report[0]) and not passes("assert f(2) == 5", "value", report[0])
    assert passes({"input": "", "output": "3"}, "io", report[1]) and not passes(
        {"input": "", "output": "4"}, "io", report[1]
    )
    assert not passes("assert f(2) == 4", "value", ["pass"]) and not passes("assert f(2) == 4", "value", None)
    assert not passes({"input": "", "output": "3"}, "io", ["exit", "Mw=="]) and passes("x", "snippet", ["pass"])
    assert not passes("assert f(2) == 4", "value", ["value", "not base64!"])


CORRECT_VALUE = {
    "plain": "def f(x):\n    return 2 * x",
    "prints and patches print": "import builtins\nprint('4 10')\nbuiltins.print = None\ndef f(x):\n    return x + x",
}
FORGED_VALUE = {
    "token forged, then os._exit": (
        "import __main__, base64, os\nt = __main__.token\n"
        "forged = [f'{t} 1 1 1', f'{t} 0 pass', f'{t} 1 pass', f'{t} -1 load', f'{t} -2 done']\n"
        "os.write(__main__.report, ('\\n' + '\\n'.join(forged) + '\\n').encode())\nos._exit(0)"
    ),
    "custom __eq__": "class A:\n    __eq__ = lambda s, o: True\ndef f(x):\n    return A()",
    "int subclass with __eq__": "class I(int):\n    __eq__ = lambda s, o: True\n    __hash__ = int.__hash__\n"
    "def f(x):\n    return I(0)",
    "monkeypatched builtins": "import builtins\nbuiltins.type = lambda *a: int\nbuiltins.isinstance = lambda *a: True\n"
    "builtins.AssertionError = None\nclass A:\n    __eq__ = lambda s, o: True\ndef f(x):\n    return A()",
    "patched encoder guessing 4": "import __main__\n__main__.enc = lambda v: ['int', '4']\ndef f(x):\n    return 0",
    "float for int": "def f(x):\n    return 2.0 * x",
    "reading the literal from the sandbox": (
        "import __main__, os, re\ndef f(x):\n    if x != 7:\n        return 2 * x\n    seen = repr(vars(__main__))\n"
        "    for d in ('.', '/tmp'):\n        for n in os.listdir(d):\n            try:\n"
        "                seen += open(os.path.join(d, n)).read()\n            except Exception:\n                pass\n"
        "    found = re.findall(r'==\\s*(\\d{9})', seen)\n    return int(found[0]) if found else 0"
    ),
}


@pytest.mark.parametrize("name", list(CORRECT_VALUE))
def test_correct_programs_pass_value_tests(name):
    assert reward([""], [CORRECT_VALUE[name]], [""], [{"tests": VALUE}], **LIMITS) == [1.0]


@pytest.mark.parametrize("name", list(FORGED_VALUE))
def test_forging_a_value_test_scores_zero(name):
    tests = VALUE + ["assert f(7) == 987654321"]  # a literal a leak would reveal
    assert reward([""], [FORGED_VALUE[name]], [""], [{"tests": tests}], **LIMITS) == [0.0]


def test_snippet_tests_remain_forgeable():
    """The same programs pass snippet tests (HumanEval's form), whose expected values enter the sandbox: why
    training uses the other two forms."""
    check = "def check(c):\n    assert c(2) == 4\n    assert c(5) == 10\ncheck(f)"
    names = ["token forged, then os._exit", "custom __eq__", "int subclass with __eq__"]
    programs = [FORGED_VALUE[name] for name in names] + [FORGED_VALUE["reading the literal from the sandbox"]]
    metas = [{"tests": [check]}] * 3 + [{"tests": ["assert f(7) == 987654321 and f(2) == 4"]}]
    assert reward([""] * 4, programs, [""] * 4, metas, **LIMITS) == [1.0] * 4


def test_the_synthetic_task_cannot_be_forged():
    meta = expression_meta(Problem(id="p", question="23+45", answer="68", level=1))
    forged = " 0\nimport __main__, os\nos.write(__main__.report, f'\\n{__main__.token} 0 pass\\n'.encode())"
    responses = [
        " 23+45",
        " 68",
        " 68.0",
        " True",
        " 0\nclass A:\n    __eq__ = lambda s, o: True\nanswer = A()",
        forged,
    ]
    assert reward([""] * 6, responses, [""] * 6, [meta] * 6, **LIMITS) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


FORGED_IO = {
    "token forged into the report, then os._exit": (  # its report file is not the program's: every path tried
        "import base64, os\nt = open('.stdin').read().split()[0]\nok = base64.b64encode(b'pass').decode()\n"
        "lines = '\\n'.join([f'{t} 0 ok {ok}', f'{t} 1 ok {ok}', f'{t} 0 pass', f'{t} 1 1 1', f'{t} -2 done'])\n"
        "fds = f'/proc/{os.getppid()}/fd'\nfor path in ['.out', *(f'{fds}/{n}' for n in os.listdir(fds))]:\n"
        "    try:\n        open(path, 'a').write('\\n' + lines + '\\n')\n    except OSError:\n        pass\n"
        "os._exit(0)"
    ),
    "printing a guess": "print(3)",
    "printing what the sandbox holds": "import os\nfor n in os.listdir('.'):\n    print(open(n).read())",
    "monkeypatched print": "import builtins, sys\nbuiltins.print = lambda *a, **k: sys.stdout.write('30')\nprint(3)",
    "right answer, then a crash": SUM + "\nraise SystemExit(1)",
}


@pytest.mark.parametrize("name", list(FORGED_IO))
def test_forging_a_stdin_stdout_test_scores_zero(name):
    assert reward([""], [FORGED_IO[name]], [""], [{"tests": IO}], **LIMITS) == [0.0]


def test_stdin_stdout_problems_pass_and_fail_by_their_output():
    fenced = "```python\nimport sys\na, b = map(int, sys.stdin.read().split())\nprint(a + b, end='')\n```"
    spaced = "print(' ', sum(map(int, input().split())), '\\n\\n')"  # whitespace is normalised
    as_float = "print(float(sum(map(int, input().split()))))"  # "3.0" is not "3"
    main = "import sys\ndef main():\n    print(sum(map(int, sys.stdin.buffer.read().split())))\n    sys.exit(0)\n" \
        "if __name__ == '__main__':\n    main()"  # fmt: skip
    programs = [SUM, fenced, spaced, main, "a, b = map(int, input().split())\nprint(a * b)", as_float]
    n = len(programs)
    assert reward([""] * n, programs, [""] * n, [{"tests": IO}] * n, **LIMITS) == [1.0] * 4 + [0.0] * 2
    assert code.run_tests(SUM, IO, code.Limits(cpu_s=2, wall_s=4))[:2] == (2, "passed")


def test_each_stdin_stdout_test_has_its_own_time_and_output_bounds():
    slow = SUM + "\nimport time\ntime.sleep(30)"  # right output, then past the test's time
    once = "import sys\nx = sys.stdin.read()\nprint(sum(map(int, x.split())))\nif '10' in x:\n    while True: pass"
    long = SUM + "\nprint(' ' * 4096)"  # the right tokens, but more than output_kb
    got = reward([""] * 3, [slow, once, long], [""] * 3, [{"tests": IO}] * 3, partial=True, test_timeout_s=0.5,
                 output_kb=1, **LIMITS)  # fmt: skip
    assert got == [0.0, 0.5, 0.0]


def test_code_rows_take_stdin_stdout_tests_and_code_contests_records():
    row = code_row({"prompt": "Add.", "tests": IO + ["assert True"]}, 0, "f")
    assert row["meta"]["tests"] == IO + ["assert True"]
    public, generated = {"input": ["1 2\n"], "output": ["3\n"]}, {"input": ["10 20\n"], "output": ["30\n"]}
    contest = {"name": "1_A", "description": "Add two numbers.", "public_tests": public,
               "private_tests": {"input": [], "output": []}, "generated_tests": generated}  # fmt: skip
    row = code_row(contest, 1, "f")
    assert row["id"] == "1_A" and row["prompt"] == "Add two numbers." and row["meta"] == {"tests": IO}
    assert reward([""], [SUM], [""], [row["meta"]], **LIMITS) == [1.0]
    with pytest.raises(ValueError, match="`public_tests` must be .* of equal lengths"):
        code_row({**contest, "public_tests": {"input": ["1"], "output": []}}, 2, "f")
    with pytest.raises(ValueError, match="needs `tests`"):
        code_row({"prompt": "Add.", "tests": [{"input": "1"}]}, 3, "f")
