"""The SGLang adapter's import and version gate, in the main environment (no SGLang needed)."""

from __future__ import annotations

import subprocess
import sys

from flashmoe.integration.sglang import MIN_SGLANG, unsupported_version_reason


def test_version_gate():
    assert MIN_SGLANG == (0, 5, 23)
    assert unsupported_version_reason("0.5.23") is None
    assert unsupported_version_reason("0.6.0") is None
    why = unsupported_version_reason("0.5.17")
    assert why is not None and "SGLang >= 0.5.23" in why and "0.5.17" in why


def test_import_is_cheap():
    # The entry point module must import neither SGLang nor prometheus_client until register() runs.
    code = (
        "import sys, flashmoe.integration.sglang as m; "
        "print(sorted(k for k in ('sglang', 'prometheus_client') if k in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]"
