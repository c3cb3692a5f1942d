"""Starting the trainer ranks as one torch.distributed group that meets on rank 0's node.

Under ``ray job submit`` the driver runs on the head node, often one without GPUs, while rank 0 may run on any
other node: an address and port of the driver's machine are not where rank 0 can listen. So the group starts in
three steps: construct every rank (each finds the GPU Ray assigned it), ask rank 0 for its own node's address and
a port free there, then set up every rank at once with that address (the process group, the model, the optimizer
and the DeepSpeed engine; each rank's setup waits until all have joined). A rank that fails to start stops the
whole group: every rank is killed and the failure is raised as one :class:`TrainerFailed` naming the rank.

    from drivers.trainer_group import start_trainer_group
    ranks = start_trainer_group(cfg, [{"num_cpus": 1, "num_gpus": 1}] * cfg.trainer.num_ranks)
"""

from __future__ import annotations

import logging

import ray
from ray.actor import ActorHandle
from ray.exceptions import RayError

from actors.trainer import TrainerRank
from drivers.stops import TrainerFailed, brief
from mugrpo_async.config import Config

log = logging.getLogger(__name__)


def start_trainer_group(cfg: Config, options_per_rank: list[dict]) -> list[ActorHandle]:
    """Create, rendezvous and set up the trainer ranks; they are ready for updates when this returns.

    Args:
        cfg: the run's config; ``trainer.num_ranks`` must equal ``len(options_per_rank)``.
        options_per_rank: the Ray ``.options(...)`` of each rank, in rank order: resources (``num_cpus``,
            ``num_gpus``), a name, a placement-group scheduling strategy, ...

    Returns:
        The rank actors in rank order.

    Raises:
        TrainerFailed: a rank died or raised while starting, or two ranks were placed on one GPU under NCCL
            (every rank is then killed).
    """
    n = len(options_per_rank)
    if n != cfg.trainer.num_ranks:
        raise ValueError(f"{n} sets of options for trainer.num_ranks = {cfg.trainer.num_ranks} ranks")
    d = cfg.to_dict()
    ranks = [TrainerRank.options(**opts).remote(d, r, n) for r, opts in enumerate(options_per_rank)]
    try:
        ((addr, port),) = _results({0: ranks[0].rendezvous_address.remote()})
        infos = _results({r: t.setup.remote(addr, port) for r, t in enumerate(ranks)})
        problems = shared_gpus(infos)
        if problems:
            raise TrainerFailed("; ".join(problems))
    except BaseException:
        for t in ranks:
            ray.kill(t)
        raise
    for info in infos:
        log.debug("trainer rank %d: %s", info["rank"], info)
    return ranks


def _results(refs_by_rank: dict[int, ray.ObjectRef]) -> list:
    """The results in rank order, as each arrives; the first failure raises at once (the other ranks may be
    blocked waiting for the failed one) as a :class:`TrainerFailed` naming its rank."""
    rank_of = {ref: r for r, ref in refs_by_rank.items()}
    out, pending = {}, list(rank_of)
    while pending:
        (ready,), pending = ray.wait(pending, num_returns=1)
        try:
            out[rank_of[ready]] = ray.get(ready)
        except RayError as err:
            raise TrainerFailed(f"trainer rank {rank_of[ready]} failed to start ({brief(err)})") from err
    return [out[r] for r in sorted(out)]


def shared_gpus(infos: list[dict]) -> list[str]:
    """Problems of a group whose ranks share a GPU under NCCL (NCCL refuses two ranks of a group on one device).

    Args:
        infos: each rank's ``TrainerRank.device_info()`` (``rank``, ``node_ip``, ``gpu_ids``, ``backend``).

    Returns:
        One message per shared GPU; empty when every NCCL rank has a GPU of its own.
    """
    seen: dict[tuple[str, str], int] = {}
    out = []
    for info in infos:
        if info["backend"] != "nccl":
            continue
        key = (info["node_ip"], info["gpu_ids"][0])
        if key in seen:
            out.append(f"trainer ranks {seen[key]} and {info['rank']} share GPU {key[1]} of node {key[0]}: give "
                       "each rank a whole GPU (trainer.gpus_per_rank: 1)")  # fmt: skip
        seen.setdefault(key, info["rank"])
    return out
