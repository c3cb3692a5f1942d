"""HF-format checkpoints written atomically (temporary folder, then rename).

A checkpoint folder holds the policy as safetensors plus the tokenizer files of the source model,
so both transformers and vLLM load it. Loading never executes code from the folder.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
    "tokenizer.model", "chat_template.jinja", "generation_config.json",
)  # fmt: skip


def atomic_replace_dir(tmp: Path, final: Path) -> None:
    """Move a finished folder ``tmp`` to ``final``, replacing an older ``final`` if present."""
    if final.exists():
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


def write_hf_files(module, state: dict, source_model: str | Path, folder: str | Path) -> None:
    """Write ``module``'s config with weights ``state`` (safetensors) and the source's tokenizer files."""
    folder = Path(folder)
    module.save_pretrained(folder, state_dict=state, safe_serialization=True)
    for name in TOKENIZER_FILES:
        src = Path(source_model) / name
        if src.is_file() and not (folder / name).exists():
            shutil.copy2(src, folder / name)


def save_hf_folder(module, state: dict, source_model: str | Path, path: str | Path) -> Path:
    """Save ``module``'s config with weights ``state`` (safetensors) and the source's tokenizer files.

    Args:
        module: the transformers model (its config and ``save_pretrained`` are used).
        state: full state dict on CPU (tied weights may appear once).
        source_model: folder the run started from; its tokenizer files are copied.
        path: destination folder; written under a temporary name and renamed when complete.
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    write_hf_files(module, state, source_model, tmp)
    atomic_replace_dir(tmp, final)
    return final


def read_build_marker(folder: str | Path, name: str) -> dict | None:
    """The JSON build marker ``name`` of a generated model folder, or None if absent or unreadable."""
    import json

    try:
        return json.loads((Path(folder) / name).read_text())
    except (OSError, ValueError):
        return None


def build_once(out_dir: Path, is_built, build, force: bool = False) -> Path:
    """``out_dir`` built by ``build()`` unless ``is_built(out_dir)``; one builder at a time (a file lock).

    The check runs again under the lock, so a process that waited for another's build returns it.
    """
    import fcntl

    if not force and is_built(out_dir):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(out_dir.with_name(f".{out_dir.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not force and is_built(out_dir):
            return out_dir  # another process built it while we waited
        return build()


class ModelFolderError(ValueError):
    """A model folder that transformers (and so vLLM) cannot load."""


def check_model_folder(path: str | Path, trust_remote_code: bool = False) -> None:
    """Fail fast, naming the folder, when it is not a loadable HF model folder (no weights read)."""
    from transformers import AutoConfig, AutoTokenizer

    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ModelFolderError(f"model folder {folder}: no config.json (not an HF model folder)")
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        raise ModelFolderError(f"model folder {folder}: no *.safetensors weights")
    for f in weights:
        _check_safetensors(f)
    try:
        AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
        AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as err:
        raise ModelFolderError(f"model folder {folder}: cannot be loaded ({err})") from None


def _check_safetensors(path: Path) -> None:
    """The file's header parses and every tensor's bytes lie inside the file (catches truncation)."""
    import json
    import struct

    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise ValueError(f"header of {n} bytes in a {size}-byte file")
            header = json.loads(f.read(n))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, struct.error) as err:
        raise ModelFolderError(f"model folder {path.parent}: {path.name} is not a safetensors file ({err})") from None
    if 8 + n + end > size:
        raise ModelFolderError(f"model folder {path.parent}: {path.name} is truncated ({size} of {8 + n + end} bytes)")


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")


def weights_digest(folder: str | Path) -> str | None:
    """SHA-256 over a model folder's weight files (name and bytes, in name order); None for a hub name or a folder
    without weights. Two folders with this digest hold the same weights, whatever machine built them."""
    folder = Path(folder)
    found = folder.glob("*") if folder.is_dir() else []
    files = sorted(p for p in found if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    if not files:
        return None
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode() + b"\0")
        with p.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()
