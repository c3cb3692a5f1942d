"""Integration: placement on clusters with fake GPUs (real Ray, vLLM, DeepSpeed on CPU).

A simulated two-node cluster (``ray.cluster_utils.Cluster``: node A with 8 fake GPUs, node B with 2, each with a
custom resource that names it) runs the drivers' own reservation and actor options with probe actors (GPU ids,
CUDA_VISIBLE_DEVICES, bundles, vLLM's own bundle lookup for a tensor-parallel engine), the dry run on the live
cluster, and a tiny run through RAY_ADDRESS whose trainer group straddles the nodes. With root, a second Ray node
inside a network namespace has another address than the driver: the trainer group meets at its rank 0's node,
and a folder that node does not share is refused before anything starts.

Probes run in subprocesses (``python -m tests.test_cluster probe|two-hosts ARGS``): the test process keeps no
connection of its own to these clusters.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow
RAY = str(Path(sys.executable).with_name("ray"))
NODE_A, NODE_B = {"num_cpus": 3, "num_gpus": 8}, {"num_cpus": 2, "num_gpus": 2}


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return {**env, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(REPO), **extra}


def _python(args: list[str], env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def _probe(address: str, mode: str, *args: str) -> dict:
    done = _python(["-m", "tests.test_cluster", mode, *args], _clean_env(RAY_ADDRESS=address))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def sim_cluster():
    """Two Ray nodes on this machine: A (3 CPUs, 8 fake GPUs, resource node_a), B (2 CPUs, 2 fake GPUs, node_b)."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={**NODE_A, "resources": {"node_a": 1}, "include_dashboard": False})  # fmt: skip
    try:
        cluster.add_node(**NODE_B, resources={"node_b": 1})
        cluster.wait_for_nodes()
        yield cluster.address
    finally:
        cluster.shutdown()


PAPER_LAYOUT = ["trainer.num_ranks=4", "rollout.num_workers=4", "trainer.gpus_per_rank=1", "rollout.gpus_per_worker=1",
                "trainer.cpus_per_rank=0.25", "rollout.cpus_per_worker=0.25"]  # fmt: skip
TP_LAYOUT = ["trainer.num_ranks=2", "rollout.num_workers=2", "rollout.tensor_parallel_size=2",
             "trainer.gpus_per_rank=1", "rollout.gpus_per_worker=1", "trainer.cpus_per_rank=0.25",
             "rollout.cpus_per_worker=0.25"]  # fmt: skip
RUN_LAYOUT = ["trainer.num_ranks=2", "trainer.cpus_per_rank=2", "trainer.gpus_per_rank=1", "trainer.num_threads=1",
              "rollout.num_workers=1", "rollout.cpus_per_worker=1", "rollout.gpus_per_worker=1"]  # fmt: skip


def _check_gpus(actor: dict) -> None:
    """Ray's GPU ids of an actor are what CUDA_VISIBLE_DEVICES says in its process."""
    assert actor["cuda_visible_devices"] == ",".join(str(i) for i in actor["gpu_ids"]), actor


def test_paper_layout_on_the_8_gpu_node_each_actor_its_own_gpu(sim_cluster):
    out = _probe(sim_cluster, "probe", *PAPER_LAYOUT)
    name = out["node_names"]
    actors = out["trainers"] + out["engines"]
    assert {name[a["node"]] for a in actors} == {"node_a"}  # node B cannot hold 4 ranks: all on the 8-GPU node
    for a in actors:
        assert len(a["gpu_ids"]) == 1
        _check_gpus(a)
    assert sorted(int(a["gpu_ids"][0]) for a in actors) == list(range(8))  # 8 bundles, 8 distinct devices
    assert [a["bundle"] for a in out["trainers"]] == [0, 1, 2, 3] and [a["bundle"] for a in out["engines"]] == [
        4, 5, 6, 7]  # fmt: skip
    assert out["bundle_nodes"] == [out["trainers"][0]["node"]] * 8


def test_zero_group_on_one_node_and_tensor_parallel_engines_on_k_bundles_of_one_node(sim_cluster):
    out = _probe(sim_cluster, "probe", *TP_LAYOUT)
    name = out["node_names"]
    # The group fits node B exactly (best fit), so it never straddles; the engines take node A.
    assert [name[t["node"]] for t in out["trainers"]] == ["node_b", "node_b"]
    for t in out["trainers"]:
        _check_gpus(t)
    for i, e in enumerate(out["engines"]):
        bundles = [2 + 2 * i, 3 + 2 * i]
        assert name[e["node"]] == "node_a" and e["gpu_ids"] == [] and e["bundle"] == bundles[0]  # CPUs only
        assert (e["vllm_bundle_indices"], e["vllm_per_worker_gpus"]) == (f"{bundles[0]},{bundles[1]}", "1")
        # vLLM's own lookup (what its Ray executor does with VLLM_RAY_BUNDLE_INDICES in the worker's group):
        assert [(b, name[n]) for b, n, _ in e["vllm_bundles"]] == [(bundles[0], "node_a"), (bundles[1], "node_a")]
        # One worker per bundle, as vLLM starts them (num_cpus=0, VLLM_RAY_PER_WORKER_GPUS GPUs): a GPU each.
        assert [name[w["node"]] for w in e["vllm_workers"]] == ["node_a", "node_a"]
        for w in e["vllm_workers"]:
            assert len(w["gpu_ids"]) == 1
            _check_gpus(w)
    gpus = [w["gpu_ids"][0] for e in out["engines"] for w in e["vllm_workers"]]
    assert len(set(gpus)) == 4


def _placement_lines(text: str) -> dict[int, str]:
    """Rank -> node name, from the placement a run logs or a dry run prints."""
    return {int(r): node for r, node in re.findall(r"trainer rank (\d+)\s+bundle \d+ on (node \d+ \([^)]*\))", text)}


def test_dry_run_places_on_the_live_cluster(sim_cluster):
    env = _clean_env(RAY_ADDRESS=sim_cluster)
    cmd = ["-m", "launch.train", "--config", "configs/tiny-cpu.yaml", "--dry-run", *RUN_LAYOUT]
    done = _python(cmd, env, timeout=300)
    assert done.returncode == 0, done.stderr
    ranks = _placement_lines(done.stdout)
    assert len(ranks) == 2 and ranks[0] != ranks[1]  # 2 CPUs per rank: one rank on each node
    assert "on 2 of 2 node(s); trainer ranks on 2" in done.stdout
    done = _python([*cmd, "trainer.num_ranks=4"], env, timeout=300)
    assert done.returncode == 2 and done.stderr == (
        "error: the actors need 9 CPUs but the cluster has 5: lower rollout.num_workers / trainer.num_ranks or "
        "rollout.cpus_per_worker / trainer.cpus_per_rank (fractions share a device)\n"
    )


def test_tiny_run_on_two_nodes_through_ray_address(sim_cluster, tiny_model, tmp_path):
    """Real vLLM and DeepSpeed on CPU in actors that hold fake GPUs; the trainer group straddles the two nodes."""
    from mugrpo_async.reporting.metrics import read_metrics

    out = tmp_path / "run"
    cmd = ["-m", "launch.train", "--config", "configs/tiny-cpu.yaml", f"model.path={tiny_model}",
           f"run.output_dir={out}", "run.name=two-nodes", "logging.progress=false", "logging.tensorboard=false",
           "schedule.total_updates=2", "schedule.mu=2", "schedule.groups_per_update=4", *RUN_LAYOUT]  # fmt: skip
    done = _python(cmd, _clean_env(RAY_ADDRESS=sim_cluster))
    assert done.returncode == 0, done.stderr[-5000:]
    ranks = _placement_lines(done.stderr)  # the run logs its placement before it reserves it
    assert len(ranks) == 2 and ranks[0] != ranks[1]
    assert [r["update"] for r in read_metrics(out, "update")] == [1, 2]
    assert (out / "checkpoints" / "final" / "config.json").is_file()
    assert not list(out.glob(".node-check-*"))  # the run folder check cleans up after itself


# ---- two hosts: one Ray node inside a network namespace --------------------------------------------------------


def _sh(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _wait_for(address: str, nodes: int, env: dict, deadline_s: float = 120) -> None:
    code = f"import ray; ray.init(); n = sum(x['Alive'] for x in ray.nodes()); assert n >= {nodes}, n"
    deadline = time.monotonic() + deadline_s
    while _python(["-c", code], {**env, "RAY_ADDRESS": address}, timeout=60).returncode != 0:
        assert time.monotonic() < deadline, f"the cluster at {address} never had {nodes} nodes"
        time.sleep(2)


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    """A Ray head at 10.x.y.1 (no GPUs) and a node at 10.x.y.2 in a network namespace (2 fake GPUs), joined by a
    veth pair; the namespaced node sees its own empty tmpfs at ``masked``."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("two-host test: needs root and the `ip` tool to create a network namespace")
    tag = f"mg{os.getpid() % 100000}"
    ns, veth_host, veth_ns = f"{tag}ns", f"{tag}h", f"{tag}n"
    net = f"10.{200 + os.getpid() % 50}.{os.getpid() // 50 % 250}"
    added = _sh("ip", "netns", "add", ns)
    if added.returncode:
        pytest.skip(f"two-host test: `ip netns add` is not permitted here ({added.stderr.strip()})")
    procs = []
    try:
        steps = [("ip", "link", "add", veth_host, "type", "veth", "peer", "name", veth_ns),
                 ("ip", "link", "set", veth_ns, "netns", ns), ("ip", "addr", "add", f"{net}.1/24", "dev", veth_host),
                 ("ip", "link", "set", veth_host, "up"),
                 ("ip", "netns", "exec", ns, "ip", "addr", "add", f"{net}.2/24", "dev", veth_ns),
                 ("ip", "netns", "exec", ns, "ip", "link", "set", veth_ns, "up"),
                 ("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")]  # fmt: skip
        for step in steps:
            failed = _sh(*step)
            if failed.returncode:
                pytest.skip(f"two-host test: `{' '.join(step)}` failed ({failed.stderr.strip()})")
        root = tmp_path_factory.mktemp("two-hosts")
        (root / "masked").mkdir()
        env = _clean_env(RAY_AUTH_MODE="disabled")
        names = ("dashboard-agent-listen", "dashboard-agent-grpc", "runtime-env-agent", "metrics-export")
        port = _free_port()
        procs.append(subprocess.Popen(
            [RAY, "start", "--head", "--block", f"--node-ip-address={net}.1", f"--port={port}", "--num-cpus=3",
             "--num-gpus=0", "--include-dashboard=false", "--disable-usage-stats",
             *(f"--{n}-port={_free_port()}" for n in names)],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        ))  # fmt: skip
        address = f"{net}.1:{port}"
        node = (f"mount -t tmpfs tmpfs {root / 'masked'} && exec {RAY} start --block --address={address} "
                f"--node-ip-address={net}.2 --num-cpus=3 --num-gpus=2 --disable-usage-stats")  # fmt: skip
        procs.append(subprocess.Popen(["ip", "netns", "exec", ns, "sh", "-c", node], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))  # fmt: skip
        _wait_for(address, 2, env)
        yield {"address": address, "env": env, "root": root, "driver": f"{net}.1", "node": f"{net}.2"}
    finally:
        for proc in reversed(procs):
            proc.terminate()
            proc.wait(timeout=60)
        _sh("ip", "link", "del", veth_host)
        _sh("ip", "netns", "del", ns)


def test_two_hosts_trainer_group_meets_on_rank_0s_node_and_the_run_folder_is_checked(two_hosts):
    """The ranks can only go to the namespaced node (the head has no GPUs); they meet at its address, not the
    driver's. A folder that node sees as another (its own tmpfs) is refused with exit 2 before any actor starts."""
    h = two_hosts
    masked, shared = h["root"] / "masked" / "run", h["root"] / "shared" / "run"
    env = {**h["env"], "RAY_ADDRESS": h["address"]}
    done = _python(["-m", "tests.test_cluster", "two-hosts", str(masked), str(shared)], env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["driver_address"] == h["driver"]
    assert out["masked_error"].startswith(f"run.output_dir: {masked} is not the driver's folder on node 1 ({h['node']}")
    assert out["shared_error"] is None
    for info in out["ranks"]:
        assert info["node_ip"] == h["node"] and info["master"][0] == h["node"] and info["backend"] == "gloo"
        assert len(info["gpu_ids"]) == 1 and info["cuda_visible_devices"] == str(info["gpu_ids"][0])
    assert len({tuple(i["master"]) for i in out["ranks"]}) == 1 and out["allreduce"] == [3.0, 3.0]


# ---- probes (run in a subprocess connected through RAY_ADDRESS) ------------------------------------------------


class _Probe:
    """Stands in for an actor: reports where Ray put it and, for a tensor-parallel engine, starts one worker per
    bundle the way vLLM's Ray executor does."""

    def info(self) -> dict:
        import ray
        from ray.util import get_current_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        out = _where()
        indices = os.environ.get("VLLM_RAY_BUNDLE_INDICES")
        if indices:
            from vllm.v1.executor.ray_utils import get_bundles_for_indices

            group, bundles = get_current_placement_group(), [int(i) for i in indices.split(",")]
            per_worker = float(os.environ["VLLM_RAY_PER_WORKER_GPUS"])
            out["vllm_bundle_indices"], out["vllm_per_worker_gpus"] = indices, os.environ["VLLM_RAY_PER_WORKER_GPUS"]
            out["vllm_bundles"] = get_bundles_for_indices(group, bundles, len(bundles))
            worker = ray.remote(_where)
            strategies = [PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=b) for b in bundles]
            refs = [worker.options(num_cpus=0, num_gpus=per_worker, scheduling_strategy=s).remote() for s in strategies]
            out["vllm_workers"] = ray.get(refs)
        return out


def _where() -> dict:
    import ray

    return {"node": ray.get_runtime_context().get_node_id(), "gpu_ids": [str(i) for i in ray.get_gpu_ids()],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}  # fmt: skip


def _probe_main(overrides: list[str]) -> dict:
    import ray
    from ray.util.placement_group import placement_group_table

    from drivers.cluster import reserve
    from drivers.run import actor_options, check_resources, start_ray
    from mugrpo_async.config import load_config

    cfg = load_config(REPO / "configs" / "tiny-cpu.yaml", overrides)
    start_ray(cfg)
    reservation = reserve(check_resources(cfg), "probe", 120)
    trainer_options, worker_options = actor_options(cfg, reservation, "probe")
    probe = ray.remote(_Probe)
    actors = [probe.options(**opts).remote() for opts in trainer_options + worker_options]
    infos = ray.get([a.info.remote() for a in actors])
    for info, opts in zip(infos, trainer_options + worker_options):
        info["bundle"] = opts["scheduling_strategy"].placement_group_bundle_index
    table = placement_group_table(reservation.group)["bundles_to_node_id"]
    names = {n["NodeID"]: next(k for k in n["Resources"] if k.startswith("node_")) for n in ray.nodes() if n["Alive"]}
    n = cfg.trainer.num_ranks
    return {"trainers": infos[:n], "engines": infos[n:], "node_names": names,
            "bundle_nodes": [table[i] for i in range(len(table))]}  # fmt: skip


def _two_hosts_main(masked: str, shared: str) -> dict:
    import ray
    import torch

    from drivers.cluster import ResourceError, check_run_folder, reserve
    from drivers.run import actor_options, check_resources, start_ray
    from drivers.trainer_group import start_trainer_group
    from mugrpo_async.config import load_config
    from tests.conftest import TINY_MODEL

    cfg = load_config(REPO / "configs" / "tiny-cpu.yaml", [f"model.path={TINY_MODEL}", "trainer.num_ranks=2",
                      "trainer.gpus_per_rank=1", "trainer.num_threads=1", "rollout.num_workers=1"])  # fmt: skip
    start_ray(cfg)
    placement = check_resources(cfg)
    errors = {}
    for key, folder in (("masked", Path(masked)), ("shared", Path(shared))):
        folder.mkdir(parents=True, exist_ok=True)
        try:
            check_run_folder(folder, placement, 120)
            errors[key] = None
        except ResourceError as err:
            errors[key] = str(err)
    reservation = reserve(placement, "two-hosts", 120)
    trainer_options, _ = actor_options(cfg, reservation, "two-hosts")
    ranks = start_trainer_group(cfg, trainer_options)
    infos = ray.get([r.device_info.remote() for r in ranks])

    def allreduce(rank) -> float:  # a collective over the group, run in each rank
        t = torch.ones(1) * (rank.rank + 1)
        torch.distributed.all_reduce(t)
        return float(t.item())

    sums = ray.get([r.__ray_call__.remote(allreduce) for r in ranks])
    return {"driver_address": ray.util.get_node_ip_address(), "masked_error": errors["masked"],
            "shared_error": errors["shared"], "ranks": infos, "allreduce": sums}  # fmt: skip


if __name__ == "__main__":
    mode, *rest = sys.argv[1:]
    result = _probe_main(rest) if mode == "probe" else _two_hosts_main(*rest)
    print(json.dumps(result))
