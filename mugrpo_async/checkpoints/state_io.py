"""Nested state (optimizer and RNG states) at rest without pickle: safetensors plus JSON.

An optimizer ``state_dict()`` is a tree of dicts, lists, tensors and plain values. :func:`save_tree`
writes every tensor to one safetensors file and the rest of the tree to JSON, where a tensor is a
``{"__tensor__": key}`` leaf. Dict keys that are not strings (torch keys per-parameter state by int)
are kept exactly. Leaves that are neither (e.g. DeepSpeed's loss-scaler object) are recorded as
``{"__live__": path}`` and, on load, taken from a *template*: the same state of a freshly built
optimizer, so loading never constructs an object from the file and never executes code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_PLAIN = (str, int, float, bool, type(None))


class StateFormatError(ValueError):
    """A state file that does not match what was written or what the template expects."""


def _encode(node: Any, path: str, tensors: dict) -> Any:
    import torch

    if isinstance(node, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = node.detach().cpu().contiguous()
        return {"__tensor__": key}
    if isinstance(node, dict):
        return {"__dict__": [[_encode_key(k, path), _encode(v, f"{path}/{k}", tensors)] for k, v in node.items()]}
    if isinstance(node, (list, tuple)):
        return {"__list__": [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(node)],
                "tuple": isinstance(node, tuple)}  # fmt: skip
    if isinstance(node, float) and node != node:
        return {"__float__": "nan"}
    if isinstance(node, float) and node in (float("inf"), float("-inf")):
        return {"__float__": "inf" if node > 0 else "-inf"}
    if isinstance(node, _PLAIN):
        return node
    return {"__live__": path}


def _encode_key(key: Any, path: str) -> Any:
    if isinstance(key, (str, int)) and not isinstance(key, bool):
        return key
    raise StateFormatError(f"{path}: dict key {key!r} of type {type(key).__name__} cannot be stored")


def save_tree(tree: Any, path: str | Path) -> list[Path]:
    """Write ``tree`` as ``<path>.json`` + ``<path>.safetensors``; returns the two files."""
    from safetensors.torch import save_file

    path = Path(path)
    tensors: dict = {}
    encoded = _encode(tree, "", tensors)
    files = [path.with_suffix(".json"), path.with_suffix(".safetensors")]
    save_file(tensors, str(files[1]))
    files[0].write_text(json.dumps(encoded))
    return files


def _decode(node: Any, tensors: dict, template: Any, path: str) -> Any:
    if isinstance(node, dict) and "__tensor__" in node:
        if node["__tensor__"] not in tensors:
            raise StateFormatError(f"{path}: tensor {node['__tensor__']} missing from the safetensors file")
        return tensors[node["__tensor__"]]
    if isinstance(node, dict) and "__dict__" in node:
        sub = template if isinstance(template, dict) else {}
        return {k: _decode(v, tensors, sub.get(k), f"{path}/{k}") for k, v in node["__dict__"]}
    if isinstance(node, dict) and "__list__" in node:
        sub = template if isinstance(template, (list, tuple)) else []
        items = [_decode(v, tensors, sub[i] if i < len(sub) else None, f"{path}/{i}")
                 for i, v in enumerate(node["__list__"])]  # fmt: skip
        return tuple(items) if node.get("tuple") else items
    if isinstance(node, dict) and "__float__" in node:
        return float(node["__float__"])
    if isinstance(node, dict) and "__live__" in node:
        if template is None:
            raise StateFormatError(f"{path}: a live object is needed here but the template has none")
        return template
    return node


def load_tree(path: str | Path, template: Any = None) -> Any:
    """Read what :func:`save_tree` wrote; ``template`` supplies the live (non-data) leaves."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    try:
        encoded = json.loads(path.with_suffix(".json").read_text())
        tensors = load_file(str(path.with_suffix(".safetensors")))
    except (OSError, ValueError, SafetensorError) as err:
        raise StateFormatError(f"{path}: unreadable state ({err})") from None
    return _decode(encoded, tensors, template, "")
