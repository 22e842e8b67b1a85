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
