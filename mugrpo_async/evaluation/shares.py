"""An evaluation spread over rollout workers: the problems split into shares, the records merged back.

An evaluation is, per benchmark, a request ``{"prompts": [...], "n", "temperature", "max_new_tokens"}``
(``drivers.periodic_eval.PeriodicEval.requests``). :func:`split_eval` cuts the problems of all benchmarks
into at most ``num_shares`` shares balanced by expected tokens, ``n x max_new_tokens`` per problem (the
most a problem can cost): problems go, costliest first, each to the share with the fewest expected tokens
so far (longest-processing-time first; ties: benchmark order, problem order, lowest share). Each share then
mixes every benchmark's problems, so hard and easy ones spread too. A share has the request's form plus
``index``, the problems' positions in their benchmark. :func:`merge_eval` puts the per-share records back
in problem order, so the records (and pass@k) are those of one worker evaluating everything. Ray-free.
"""

from __future__ import annotations

import heapq


def _cost(request: dict) -> int:
    return request["n"] * request["max_new_tokens"]


def split_eval(requests: dict[str, dict], num_shares: int) -> list[dict[str, dict]]:
    """At most ``num_shares`` non-empty shares covering every problem of ``requests`` once (see the module)."""
    if num_shares < 1:
        raise ValueError(f"need at least one share, got {num_shares}")
    order = sorted(((-_cost(r), b, i) for b, r in enumerate(requests.values()) for i in range(len(r["prompts"]))))
    heap = [(0, s) for s in range(num_shares)]  # (expected tokens so far, share)
    picked: list[dict[str, list[int]]] = [{} for _ in range(num_shares)]
    names = list(requests)
    for neg_cost, b, i in order:
        load, s = heapq.heappop(heap)
        picked[s].setdefault(names[b], []).append(i)
        heapq.heappush(heap, (load - neg_cost, s))
    shares = []
    for chosen in picked:
        if not chosen:
            continue
        share = {}
        for name in names:  # benchmark order, problems in order
            index = sorted(chosen.get(name, []))
            if index:
                r = requests[name]
                share[name] = {**r, "prompts": [r["prompts"][i] for i in index], "index": index}
        shares.append(share)
    return shares


def merge_eval(requests: dict[str, dict], shares: list[dict[str, dict]], results: list[dict[str, list]]) -> dict:
    """Per benchmark, the records of ``results`` (one ``{benchmark: records}`` per share) in problem order.

    Raises:
        ValueError: a problem without a record, with two, or a share whose records do not match its problems.
    """
    merged: dict[str, list] = {name: [None] * len(r["prompts"]) for name, r in requests.items()}
    for share, result in zip(shares, results, strict=True):
        for name, part in share.items():
            records = result[name]
            if len(records) != len(part["index"]):
                raise ValueError(f"{name}: {len(records)} records for {len(part['index'])} problems of a share")
            for i, record in zip(part["index"], records):
                if merged[name][i] is not None:
                    raise ValueError(f"{name}: problem {i} evaluated twice")
                merged[name][i] = record
    for name, records in merged.items():
        missing = [i for i, r in enumerate(records) if r is None]
        if missing:
            raise ValueError(f"{name}: problems {missing[:5]} have no record")
    return merged
