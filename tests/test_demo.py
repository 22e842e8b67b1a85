"""flashmoe.demo: the README's main command and the server helper the tests use leave nothing behind."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_help_names_the_module_command():
    out = subprocess.run(
        [sys.executable, "-m", "flashmoe.demo", "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: python -m flashmoe.demo "), out.stdout


@pytest.mark.vllm
def test_failed_start_removes_the_servers_temp_dir(tmp_path):
    pytest.importorskip("vllm")
    from flashmoe.demo import VLLMServer

    server = VLLMServer(tmp_path / "no-such-model", startup_timeout=300)
    assert server.tmp_dir.is_dir() and server.log_path.parent == server.tmp_dir
    with pytest.raises(RuntimeError, match="exited"):
        with server:
            pass
    assert not server.tmp_dir.exists()


def test_a_server_makes_its_own_metrics_bridge(tmp_path, monkeypatch):
    """A process that loaded the vLLM plugin itself (an engine config built in-process) has the metrics
    bridge variable set; a server it starts must not inherit it, or it takes itself for a worker and its
    /metrics shows no flashmoe series (seen when the full suite ran such a test before the metrics one)."""
    import os

    from flashmoe.demo import VLLMServer

    monkeypatch.setenv("FLASHMOE_METRICS_BRIDGE_DIR", str(tmp_path / "parent-bridge"))
    server = VLLMServer(tmp_path / "model")
    try:
        assert "FLASHMOE_METRICS_BRIDGE_DIR" not in server.env
        assert server.env["PATH"] == os.environ["PATH"]  # the rest is inherited
    finally:
        server.close()
    assert not server.tmp_dir.exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_startup_timeout_says_whether_the_server_was_still_compiling(tmp_path):
    """A server that never turns healthy while a JIT build runs in its processes (here a process named
    ninja) times out naming the compilers, so a slow first start is not taken for a hang; one with no
    compiler says so."""
    from flashmoe.demo import VLLMServer

    ninja = tmp_path / "ninja"
    ninja.symlink_to(subprocess.run(["which", "sleep"], capture_output=True, text=True).stdout.strip())
    for child, expect in ((str(ninja), r"compilers were running .*\(ninja x1\)"), ("sleep", "no compiler")):
        server = VLLMServer(tmp_path / "model", startup_timeout=3, log_path=tmp_path / "server.log")
        server.cmd = ["sh", "-c", f"{child} 60 & sleep 60"]
        with pytest.raises(TimeoutError, match=expect):
            with server:
                pass
        assert server.proc.poll() is not None  # stopped, its group with it


def test_a_startup_timeout_names_the_compilers_still_running(tmp_path):
    """compilers_note reads the server's process session from /proc: two processes named like JIT tools (copies
    of `sleep`) in a session of their own are counted by name; once they are gone, the note says so."""
    import os
    import shutil
    import signal
    import time
    from pathlib import Path

    from flashmoe.demo.server import compilers_note, session_commands

    sleep = shutil.which("sleep")
    if sleep is None or not Path("/proc/self/stat").exists():
        pytest.skip("needs Linux /proc and sleep")
    for name in ("ninja", "nvcc"):
        shutil.copy(sleep, tmp_path / name)
    script = f"'{tmp_path / 'ninja'}' 30 & '{tmp_path / 'nvcc'}' 30 & wait"
    shell = subprocess.Popen(["sh", "-c", script], start_new_session=True)  # its pid is the session's id
    try:
        deadline = time.monotonic() + 10
        while not {"ninja", "nvcc"} <= set(session_commands(shell.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        note = compilers_note(shell.pid)
        assert "ninja x1" in note and "nvcc x1" in note and "a JIT build had not finished" in note, note
    finally:
        os.killpg(shell.pid, signal.SIGKILL)
        shell.wait()
    deadline = time.monotonic() + 10  # killed: gone, or zombies until reaped (not counted)
    while compilers_note(shell.pid) != "no compiler was running in the server's processes":
        assert time.monotonic() < deadline, compilers_note(shell.pid)
        time.sleep(0.05)
