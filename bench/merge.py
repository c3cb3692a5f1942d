"""``bench.run --merge``: put the sections of a partial run (``--only``) into an existing ``RESULTS.md`` in place.

A full run takes an hour on the 2-core machine; after a change to one benchmark, ``--only N --merge`` reruns that
one and replaces, in the existing file, its rows of the summary table, its section and its lines of the closing
note, keeping the others (and saying in the header which sections came from which command). A run of every
benchmark in the file (``bench.run --merge`` without ``--only``) replaces all of it but the text after the closing
note (analyses such as the spread of ``bench.spread``), which stays. Pure text.
"""

from __future__ import annotations

import re

_ROW = re.compile(r"^\| (\d+) \|")
_SECTION = re.compile(r"^## (\d+)\. ")
_NOTE_ITEM = re.compile(r"^- (\d+): ")


def _split(text: str) -> tuple[list[str], list[str], dict[int, list[str]], list[str], list[str]]:
    """(the header down to the table's separator, the table's rows, the numbered sections, the closing note, and
    everything from the first other ``## `` heading after it, verbatim)."""
    head, rows, sections, note, extra = [], [], {}, [], []
    current: list[str] | None = None
    for line in text.rstrip("\n").split("\n"):
        if current is extra:
            pass
        elif line.startswith("## Closing note"):
            current = note
        elif m := _SECTION.match(line):
            current = sections.setdefault(int(m.group(1)), [])
        elif line.startswith("## ") and current is not None:
            current = extra
        elif current is None:
            (rows if _ROW.match(line) else head if not rows else []).append(line)
            continue
        current.append(line)
    return head, rows, sections, note, extra


def _numbered(lines: list[str], pattern: re.Pattern) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for line in lines:
        if m := pattern.match(line):
            out.setdefault(int(m.group(1)), []).append(line)
    return out


def _met(note: list[str]) -> dict[int, list[str]]:
    """The closing note's "Targets met" entries by benchmark number."""
    line = next((x for x in note if x.startswith("Targets met: ")), "Targets met: none.")
    body = line.removeprefix("Targets met: ").removesuffix(".")
    items = [] if body == "none" else body.split("; ")
    out: dict[int, list[str]] = {}
    for item in items:
        n = item.split(":", 1)[0]
        if n.isdigit():
            out.setdefault(int(n), []).append(item)
    return out


def merge_results(old: str, new: str, command: str) -> str:
    """``old`` with every benchmark that ``new`` (a partial run's text) holds replaced by ``new``'s version."""
    o_head, o_rows, o_secs, o_note, extra = _split(old)
    n_head, n_rows, n_secs, n_note, _ = _split(new)
    numbers = set(n_secs)
    if set(o_secs) <= numbers:  # a full run: its own header (command, machine, load), the old file's extra text
        out = n_head + n_rows + [""] + [x for k in sorted(n_secs) for x in _ended(n_secs[k])]
        return "\n".join(out + n_note + [""] + extra).rstrip("\n") + "\n"
    rows = {**_numbered(o_rows, _ROW), **_numbered(n_rows, _ROW)}
    sections = {**o_secs, **n_secs}
    met = {**{k: v for k, v in _met(o_note).items() if k not in numbers}, **_met(n_note)}
    items = {**{k: v for k, v in _numbered(o_note, _NOTE_ITEM).items() if k not in numbers},
             **_numbered(n_note, _NOTE_ITEM)}  # fmt: skip
    out = _stamped(o_head, numbers, command) + [r for k in sorted(rows) for r in rows[k]] + [""]
    out += [x for k in sorted(sections) for x in _ended(sections[k])]
    met_items = [x for k in sorted(met) for x in met[k]]
    out += ["## Closing note", "", "Targets met: " + ("; ".join(met_items) or "none") + ".", ""]
    if any(items.values()):
        out += ["Targets missed, and what limits them:"] + [x for k in sorted(items) for x in items[k]] + [""]
    rest = [x for x in o_note if x and not x.startswith(("Targets met", "Targets missed", "- ", "## Closing"))]
    out += [x for line in rest for x in (line, "")] + extra
    return "\n".join(out).rstrip("\n") + "\n"


def _ended(body: list[str]) -> list[str]:
    """A section's lines ending in one blank line."""
    return body if body and body[-1] == "" else [*body, ""]


_STAMP = re.compile(r"^Sections? ([\d, ]+): from ")


def _stamped(head: list[str], numbers: set[int], command: str) -> list[str]:
    """The header with a line saying where ``numbers`` came from, above the table; earlier such lines that
    ``numbers`` supersede entirely are dropped."""
    keep: list[str] = []
    for x in head:
        if (m := _STAMP.match(x)) and set(map(int, m.group(1).split(", "))) <= numbers:
            continue
        if x or not keep or keep[-1]:  # no two blank lines in a row (a dropped line leaves its blank one)
            keep.append(x)
    at = next((i for i, x in enumerate(keep) if x.startswith("| # |")), len(keep))
    word = "Sections" if len(numbers) > 1 else "Section"
    stamp = f"{word} {', '.join(map(str, sorted(numbers)))}: from `{command}` (merged into the file in place)."
    return keep[:at] + [stamp, ""] + keep[at:]
