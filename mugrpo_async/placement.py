"""Where every actor of a run goes: the bundles it reserves and the node each bundle lands on.

Pure (no Ray): :func:`plan_placement` takes a cluster description (:class:`Node` list, from ``--cluster`` text
through :func:`parse_cluster`, or from the live cluster) and the config, and returns a :class:`Placement`, or
raises :class:`PlacementError` naming the config keys to change. The driver reserves exactly these bundles, each
pinned to its node, in one Ray placement group before any actor starts (all or nothing); the dry run prints them.

Layout rules (``placement.mode = split``: engines and trainer ranks never share a bundle):

- trainer rank r: one bundle ``{CPU: trainer.cpus_per_rank, GPU: trainer.gpus_per_rank}``;
- rollout worker i, an engine of tensor-parallel size k: k bundles on one node, ``{GPU: rollout.gpus_per_worker}``
  each (one per vLLM worker), the first also holding the worker's ``rollout.cpus_per_worker`` CPUs;
- the trainer group goes on one node whenever a layout allows it (best fit: the fullest node that holds it), else
  on as few nodes as hold it; ranks are numbered in node order, rank 0 on the group's first node;
- engines go first-fit in node order (after a one-node trainer group; when the group must straddle, first);
- GPUs are unit resources, as Ray counts them: a fractional request takes part of one device (best fit), a
  request of one takes a whole free device.

Bundles are numbered trainer ranks first (rank order), then the engines' (worker order).

``placement.mode = colocated`` (the staged mode's layout: engine i and trainer rank i share device i): one bundle
per device, ``{CPU: trainer.cpus_per_rank (+ rollout.cpus_per_worker on an engine's first device), GPU:
trainer.gpus_per_rank + rollout.gpus_per_worker}``; trainer rank r runs in bundle r and takes its
``gpus_per_rank`` of it, the engine of devices i*k .. i*k+k-1 (k = ``rollout.tensor_parallel_size``) runs in their
first and its vLLM workers take ``gpus_per_worker`` of each. Two actors in one bundle share that bundle's one device
(a bundle's fraction of a GPU is always part of one device; two fractional bundles might not be the same one).
``rollout.num_workers * k = trainer.num_ranks`` (a config rule). Engines with their k ranks go on one node when the
cluster allows it, else on as few nodes as hold them (an engine's devices are always on one node).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from mugrpo_async.config import Config

EPS = 1e-9


class PlacementError(ValueError):
    """The actors do not fit the cluster; the message names the keys to change."""


@dataclass(frozen=True)
class Node:
    """One node of a cluster.

    Attributes:
        name: How the plan names it (``node 0``; a live node's address).
        gpus: Whole GPUs on the node.
        cpus: CPUs on the node (``math.inf`` when the description leaves them out).
        node_id: Ray's node id (a live node: its bundles are pinned to it), else empty.
        address: The node's IP address (a live node), else empty.
    """

    name: str
    gpus: int
    cpus: float = math.inf
    node_id: str = ""
    address: str = ""

    def describe(self) -> str:
        cpus = "CPUs not described" if math.isinf(self.cpus) else f"{self.cpus:g} CPUs"
        return f"{self.gpus} GPU{'s' * (self.gpus != 1)}, {cpus}"


@dataclass(frozen=True)
class Bundle:
    """One reserved bundle: its resources and the node (index into :attr:`Placement.nodes`) it lands on."""

    index: int
    node: int
    cpus: float
    gpus: float

    def spec(self) -> dict[str, float]:
        """Ray's bundle dict (zero amounts left out)."""
        return {k: v for k, v in (("CPU", self.cpus), ("GPU", self.gpus)) if v > 0}


@dataclass(frozen=True)
class Slot:
    """An actor's reservation: ``bundles`` (indices into :attr:`Placement.bundles`); the actor runs in the first."""

    role: str  # "trainer" or "rollout"
    index: int  # trainer rank or rollout worker index
    bundles: tuple[int, ...]
    node: int


@dataclass(frozen=True)
class Placement:
    """Every bundle of a run and the node each lands on; trainer slots in rank order, rollout slots by worker."""

    nodes: tuple[Node, ...]
    bundles: tuple[Bundle, ...]
    trainers: tuple[Slot, ...]
    engines: tuple[Slot, ...]

    def specs(self) -> list[dict[str, float]]:
        """The placement group's bundles, in order."""
        return [b.spec() for b in self.bundles]

    def used_nodes(self) -> list[int]:
        """Nodes that host at least one bundle, in node order."""
        return sorted({b.node for b in self.bundles})

    def trainer_nodes(self) -> list[int]:
        """Nodes of the trainer group, rank 0's first."""
        return list(dict.fromkeys(s.node for s in self.trainers))


@dataclass
class _Free:
    """What is left of one node while planning: CPUs and each GPU's unused fraction."""

    cpus: float
    gpus: list[float] = field(default_factory=list)

    def take(self, cpus: float, gpus: float) -> bool:
        """Reserve ``cpus`` and ``gpus`` if they fit (False, nothing taken, otherwise)."""
        if cpus > self.cpus + EPS:
            return False
        if gpus >= 1 - EPS:
            whole = [i for i, f in enumerate(self.gpus) if f >= 1 - EPS][: round(gpus)]
            if len(whole) < round(gpus):
                return False
            for i in whole:
                self.gpus[i] = 0.0
        elif gpus > 0:
            fits = [i for i, f in enumerate(self.gpus) if f >= gpus - EPS]
            if not fits:
                return False
            best = min(fits, key=lambda i: (self.gpus[i], i))  # best fit keeps whole devices free
            self.gpus[best] -= gpus
        self.cpus -= cpus
        return True

    def copy(self) -> _Free:
        return _Free(self.cpus, list(self.gpus))


def _fresh(nodes: Sequence[Node]) -> list[_Free]:
    return [_Free(n.cpus, [1.0] * n.gpus) for n in nodes]


def _engine_shape(cfg: Config) -> list[tuple[float, float]]:
    """(CPUs, GPUs) of each bundle of one engine: the worker's CPUs ride in the first."""
    r = cfg.rollout
    return [(r.cpus_per_worker if i == 0 else 0.0, r.gpus_per_worker) for i in range(r.tensor_parallel_size)]


def _fit_all(free: _Free, shape: list[tuple[float, float]]) -> bool:
    """Take every bundle of ``shape`` from ``free`` or none of them."""
    trial = free.copy()
    if all(trial.take(c, g) for c, g in shape):
        free.cpus, free.gpus = trial.cpus, trial.gpus
        return True
    return False


def _capacity(free: _Free, cpus: float, gpus: float, limit: int) -> int:
    """How many bundles of (cpus, gpus) fit in ``free`` (at most ``limit``)."""
    trial, n = free.copy(), 0
    while n < limit and trial.take(cpus, gpus):
        n += 1
    return n


def _single_nodes(cfg: Config, free: list[_Free]) -> list[int]:
    """Nodes that hold the whole trainer group, fullest first (best fit: least left over), then in node order."""
    t = cfg.trainer
    fits = [i for i, f in enumerate(free) if _capacity(f, t.cpus_per_rank, t.gpus_per_rank, t.num_ranks) == t.num_ranks]
    return sorted(fits, key=lambda i: (sum(free[i].gpus), free[i].cpus, i))


def _fewest_nodes(cfg: Config, free: list[_Free]) -> list[int] | None:
    """The node of each rank on as few nodes as hold the group (largest share first, ranks grouped by node)."""
    t = cfg.trainer
    caps = [_capacity(f, t.cpus_per_rank, t.gpus_per_rank, t.num_ranks) for f in free]
    ranks: list[int] = []
    for i in sorted(range(len(free)), key=lambda i: (-caps[i], i)):
        ranks += [i] * min(caps[i], t.num_ranks - len(ranks))
    return ranks if len(ranks) == t.num_ranks else None


def _put_trainers(cfg: Config, free: list[_Free], ranks: list[int]) -> bool:
    t = cfg.trainer
    return all(free[node].take(t.cpus_per_rank, t.gpus_per_rank) for node in ranks)


def _put_engines(cfg: Config, free: list[_Free]) -> list[int] | None:
    """Each engine's node, first fit in node order (None when one does not fit)."""
    shape, nodes = _engine_shape(cfg), []
    for _ in range(cfg.rollout.num_workers):
        node = next((j for j, f in enumerate(free) if _fit_all(f, shape)), None)
        if node is None:
            return None
        nodes.append(node)
    return nodes


def _layouts(cfg: Config, nodes: Sequence[Node]) -> Iterator[tuple[list[int], list[int]]]:
    """Candidate (node of each rank, node of each engine), best first: the trainer group on one node (each node that
    holds it, fullest first), then on the fewest nodes left after the engines, then on the fewest nodes before
    them. Engines of one shape fill nodes in order, which packs as many as any order would."""
    for node in _single_nodes(cfg, _fresh(nodes)):
        free = _fresh(nodes)
        if _put_trainers(cfg, free, [node] * cfg.trainer.num_ranks):
            engines = _put_engines(cfg, free)
            if engines is not None:
                yield [node] * cfg.trainer.num_ranks, engines
    free = _fresh(nodes)
    engines = _put_engines(cfg, free)
    ranks = _fewest_nodes(cfg, free) if engines is not None else None
    if engines is not None and ranks is not None:
        yield ranks, engines
    free = _fresh(nodes)
    ranks = _fewest_nodes(cfg, free)
    if ranks is not None and _put_trainers(cfg, free, ranks):
        engines = _put_engines(cfg, free)
        if engines is not None:
            yield ranks, engines


def _build(cfg: Config, nodes: Sequence[Node], ranks: list[int], engines: list[int]) -> Placement:
    """Number the bundles: the trainer ranks' first (rank order), then each engine's."""
    t = cfg.trainer
    bundles = [Bundle(r, node, t.cpus_per_rank, t.gpus_per_rank) for r, node in enumerate(ranks)]
    trainers = [Slot("trainer", r, (r,), node) for r, node in enumerate(ranks)]
    shape, slots = _engine_shape(cfg), []
    for i, node in enumerate(engines):
        first = len(bundles)
        bundles += [Bundle(first + k, node, c, g) for k, (c, g) in enumerate(shape)]
        slots.append(Slot("rollout", i, tuple(range(first, first + len(shape))), node))
    return Placement(tuple(nodes), tuple(bundles), tuple(trainers), tuple(slots))


def _device_shape(cfg: Config) -> list[tuple[float, float]]:
    """Colocated: (CPUs, GPUs) of the k device bundles of one engine and its k trainer ranks."""
    r, t = cfg.rollout, cfg.trainer
    gpus = t.gpus_per_rank + r.gpus_per_worker
    return [(t.cpus_per_rank + (r.cpus_per_worker if j == 0 else 0.0), gpus) for j in range(r.tensor_parallel_size)]


def _colocated_units(cfg: Config, nodes: Sequence[Node]) -> list[int] | None:
    """Colocated: the node of each engine (with its k ranks): one node holding all, the fullest such first; else the
    nodes that hold most, largest first (None when they do not fit)."""
    shape, n = _device_shape(cfg), cfg.rollout.num_workers

    def capacity(free: _Free) -> int:
        count = 0
        while count < n and _fit_all(free, shape):
            count += 1
        return count

    caps = [capacity(f) for f in _fresh(nodes)]
    whole = sorted((i for i, c in enumerate(caps) if c == n), key=lambda i: (nodes[i].gpus, nodes[i].cpus, i))
    if whole:
        return [whole[0]] * n
    units: list[int] = []
    for i in sorted(range(len(nodes)), key=lambda i: (-caps[i], i)):
        units += [i] * min(caps[i], n - len(units))
    return units if len(units) == n else None


def _plan_colocated(cfg: Config, nodes: Sequence[Node]) -> Placement:
    """Colocated layout (module docstring): bundle d is device d, shared by trainer rank d and engine d // k."""
    units = _colocated_units(cfg, nodes)
    if units is None:
        raise PlacementError(_why_not_colocated(cfg, nodes))
    shape, k = _device_shape(cfg), cfg.rollout.tensor_parallel_size
    bundles = [Bundle(i * k + j, node, c, g) for i, node in enumerate(units) for j, (c, g) in enumerate(shape)]
    trainers = [Slot("trainer", b.index, (b.index,), b.node) for b in bundles]
    engines = [Slot("rollout", i, tuple(range(i * k, (i + 1) * k)), node) for i, node in enumerate(units)]
    return Placement(tuple(nodes), tuple(bundles), tuple(trainers), tuple(engines))


def _why_not_colocated(cfg: Config, nodes: Sequence[Node]) -> str:
    shape, k = _device_shape(cfg), cfg.rollout.tensor_parallel_size
    cpus, gpus = sum(c for c, _ in shape) * cfg.rollout.num_workers, shape[0][1] * cfg.trainer.num_ranks
    have_cpus, have_gpus = sum(n.cpus for n in nodes), sum(n.gpus for n in nodes)
    if gpus > have_gpus + EPS or cpus > have_cpus + EPS:
        return (f"placement.mode colocated: the {cfg.trainer.num_ranks} shared devices need {gpus:g} GPUs and "
                f"{cpus:g} CPUs but the cluster has {have_gpus:g} and {have_cpus:g}: lower trainer.num_ranks and "
                "rollout.num_workers, or the cpus/gpus per rank and per worker")  # fmt: skip
    return (f"placement.mode colocated: each engine needs rollout.tensor_parallel_size = {k} devices of one node, "
            f"each with trainer.cpus_per_rank + rollout.cpus_per_worker CPUs, and the nodes do not hold "
            f"rollout.num_workers = {cfg.rollout.num_workers} of them ({_nodes_text(nodes)})")  # fmt: skip


def plan_placement(cfg: Config, nodes: Sequence[Node]) -> Placement:
    """Every actor's bundles and nodes on ``nodes`` (see the module docstring for the rules).

    Raises:
        PlacementError: the actors do not fit; the message names the keys to change.
    """
    if not nodes:
        raise PlacementError("the cluster has no nodes to place rollout.num_workers and trainer.num_ranks on")
    if cfg.placement.mode == "colocated":
        return _plan_colocated(cfg, nodes)
    for ranks, engines in _layouts(cfg, nodes):
        return _build(cfg, nodes, ranks, engines)
    raise PlacementError(_why_not(cfg, nodes))


def _why_not(cfg: Config, nodes: Sequence[Node]) -> str:
    """The reason the actors do not fit ``nodes``, naming the keys."""
    r, t = cfg.rollout, cfg.trainer
    k = r.tensor_parallel_size
    tp = " x rollout.tensor_parallel_size" if k > 1 else ""
    have = {"CPU": sum(n.cpus for n in nodes), "GPU": sum(n.gpus for n in nodes)}
    need = {"CPU": r.num_workers * r.cpus_per_worker + t.num_ranks * t.cpus_per_rank,
            "GPU": r.num_workers * k * r.gpus_per_worker + t.num_ranks * t.gpus_per_rank}  # fmt: skip
    for res, amount in need.items():
        if amount > have[res] + EPS:
            return (f"the actors need {amount:g} {res}s but the cluster has {have[res]:g}: lower rollout.num_workers"
                    f"{tp if res == 'GPU' else ''} / trainer.num_ranks or rollout.{res.lower()}s_per_worker / "
                    f"trainer.{res.lower()}s_per_rank (fractions share a device)")  # fmt: skip
    if not any(_capacity(f, t.cpus_per_rank, t.gpus_per_rank, 1) for f in _fresh(nodes)):
        return (f"trainer.cpus_per_rank / trainer.gpus_per_rank: one rank needs {t.cpus_per_rank:g} CPUs and "
                f"{t.gpus_per_rank:g} GPU on one node, and no node has them ({_nodes_text(nodes)})")  # fmt: skip
    if not any(_fit_all(f, _engine_shape(cfg)) for f in _fresh(nodes)):
        return (f"rollout.tensor_parallel_size / rollout.cpus_per_worker: one engine needs {k} x "
                f"{r.gpus_per_worker:g} GPU and {r.cpus_per_worker:g} CPUs on one node, and no node has them "
                f"({_nodes_text(nodes)})")  # fmt: skip
    return (f"the actors fit the cluster's totals but not its nodes ({_nodes_text(nodes)}): each engine takes "
            f"rollout.tensor_parallel_size = {k} GPU bundles of one node and each trainer rank one bundle; lower "
            "rollout.num_workers / trainer.num_ranks or their cpus/gpus per actor")  # fmt: skip


def _nodes_text(nodes: Sequence[Node]) -> str:
    return "; ".join(f"{n.name}: {n.describe()}" for n in nodes)


_NODE = re.compile(r"^(?:(\d+)x)?(\d+)(?::(\d+(?:\.\d+)?))?$")


def parse_cluster(text: str) -> tuple[Node, ...]:
    """Nodes from a description: ``2x8`` (2 nodes of 8 GPUs), ``8`` (one node), ``2x8:64`` (64 CPUs each), or a
    comma list of such groups for uneven nodes (``8,4:32``). CPUs left out are not checked.

    Raises:
        ValueError: the text is not such a description (the message says what is).
    """
    nodes: list[Node] = []
    for part in text.replace(" ", "").split(","):
        m = _NODE.match(part)
        if not m or int(m.group(1) or 1) < 1:
            raise ValueError(f"{text!r} is not a cluster description: use NxG (N nodes of G GPUs), G (one node), "
                             "an optional :C (C CPUs per node), or a comma list of these (8,4:32)")  # fmt: skip
        cpus = float(m.group(3)) if m.group(3) else math.inf
        for _ in range(int(m.group(1) or 1)):
            nodes.append(Node(f"node {len(nodes)}", int(m.group(2)), cpus))
    return tuple(nodes)
