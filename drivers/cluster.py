"""The cluster side of a run's set-up: its nodes, the one placement group that reserves every actor, the run folder.

:func:`live_nodes` describes the connected cluster for :func:`mugrpo_async.placement.plan_placement`;
:func:`reserve` turns the plan into one Ray placement group whose bundles are pinned to the planned nodes (the
``ray.io/node-id`` label), so that every actor's resources are held before any actor starts, or none are;
:func:`check_run_folder` makes sure every node that hosts an actor sees the driver's run folder.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from pathlib import Path

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from mugrpo_async.placement import Node, Placement

log = logging.getLogger(__name__)
NODE_ID_LABEL = "ray.io/node-id"  # every Ray node carries its id under this label


class ResourceError(RuntimeError):
    """The cluster cannot host the run as configured (its nodes, its free resources, its view of the run folder);
    the message names the keys. ``launch.train`` exits with code 2."""


def live_nodes() -> tuple[Node, ...]:
    """The alive nodes of the connected cluster: the driver's first, then by address and id."""
    here = ray.get_runtime_context().get_node_id()
    alive = sorted((n for n in ray.nodes() if n["Alive"]),
                   key=lambda n: (n["NodeID"] != here, n["NodeManagerAddress"], n["NodeID"]))  # fmt: skip
    return tuple(
        Node(name=f"node {i} ({n['NodeManagerAddress']}, {n['NodeID'][:8]})", gpus=round(n["Resources"].get("GPU", 0)),
             cpus=n["Resources"].get("CPU", 0.0), node_id=n["NodeID"], address=n["NodeManagerAddress"])
        for i, n in enumerate(alive)
    )  # fmt: skip


@dataclass
class Reservation:
    """A granted placement group holding every bundle of :attr:`placement`."""

    placement: Placement
    group: PlacementGroup

    def strategy(self, bundle: int) -> PlacementGroupSchedulingStrategy:
        """Schedule an actor in ``bundle`` (its child tasks and actors are not captured: they reserve nothing)."""
        return PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=bundle)

    def release(self) -> None:
        """Give the bundles back (Ray ends the actors still in them)."""
        remove_placement_group(self.group)


def reserve(placement: Placement, name: str, timeout_s: float) -> Reservation:
    """Reserve every bundle of ``placement`` on its planned node, all or nothing, within ``timeout_s``.

    Raises:
        ResourceError: the cluster did not grant them in time (other work holds the resources).
    """
    pinned = [{NODE_ID_LABEL: placement.nodes[b.node].node_id} for b in placement.bundles]
    assert all(p[NODE_ID_LABEL] for p in pinned), "a described cluster cannot be reserved; plan on live_nodes()"
    group = placement_group(placement.specs(), strategy="PACK", name=name, bundle_label_selector=pinned)
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except GetTimeoutError:
        remove_placement_group(group)
        raise ResourceError(
            f"placement.timeout_s: the cluster did not grant the run's {len(pinned)} bundles within {timeout_s:g} s: "
            "other work holds part of the resources (`ray status` shows what is in use); free them, or wait longer"
        ) from None
    log.info("reserved %d bundles on %d node(s)", len(pinned), len(placement.used_nodes()))
    return Reservation(placement, group)


@ray.remote(num_cpus=0)
def _read_marker(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def check_run_folder(run_dir: Path, placement: Placement, timeout_s: float) -> None:
    """Check that every node hosting an actor sees ``run_dir`` as the driver does: the driver writes a file with a
    random token there and a task pinned to each node reads it back.

    Raises:
        ResourceError: a node does not see the file (another disk at the same path, or no such folder there), or
            could not be asked within ``timeout_s``; the message names ``run.output_dir`` and the nodes.
    """
    token = uuid.uuid4().hex
    marker = run_dir / f".node-check-{token[:12]}"
    marker.write_text(token)
    nodes = [placement.nodes[i] for i in placement.used_nodes()]
    try:
        refs = [_read_marker.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n.node_id, soft=False))
                .remote(str(marker)) for n in nodes]  # fmt: skip
        seen = ray.get(refs, timeout=timeout_s)
    except GetTimeoutError:
        raise ResourceError(f"run.output_dir: could not check within placement.timeout_s = {timeout_s:g} s that the "
                            f"nodes hosting actors see {run_dir}") from None  # fmt: skip
    finally:
        marker.unlink(missing_ok=True)
    blind = [n.name for n, text in zip(nodes, seen) if text != token]
    if blind:
        raise ResourceError(
            f"run.output_dir: {run_dir} is not the driver's folder on {', '.join(blind)} (a file written there by the "
            "driver is not seen): every node hosting an actor writes its share of each checkpoint there, so use a "
            "folder of a filesystem all nodes mount at the same path"
        )
