"""The README's direct-use example, taken from README.md itself so the two cannot drift: it runs as a
standalone script on CPU, and its output is the reference's for its inputs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from flashmoe import moe_reference

README = Path(__file__).resolve().parent.parent / "README.md"


def direct_use_example() -> str:
    text = README.read_text()
    start = text.index("**Direct use**")
    begin = text.index("```python\n", start) + len("```python\n")
    return text[begin : text.index("\n```", begin) + 1]


def test_readme_direct_use_example_runs_as_a_script(tmp_path):
    script = tmp_path / "direct_use.py"
    script.write_text(direct_use_example())
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1] == "torch.Size([4, 256]) torch.bfloat16", done.stdout


def test_readme_direct_use_example_computes_the_reference(capsys):
    ns: dict = {}
    exec(compile(direct_use_example(), str(README), "exec"), ns)
    capsys.readouterr()
    assert ns["moe"].backend == "reference"
    assert bool((ns["topk_ids"] == -1).any())  # the example shows the -1 convention
    expected = moe_reference(ns["hidden_states"], ns["topk_ids"], ns["topk_weights"], ns["w13"], ns["w2"])
    assert torch.equal(ns["out"], expected)
