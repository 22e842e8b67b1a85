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
