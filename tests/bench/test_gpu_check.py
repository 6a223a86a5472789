"""bench/gpu_check.sh's arguments: a wrong one is one error: line and exit 2, before anything runs."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.sh"


@pytest.mark.parametrize("args, said", [
    (["--only"], "error: --only needs a part: throughput, finetune, fp8, fp8-variants, harness or canary"),
    (["--only", "bogus"], "error: --only 'bogus': use throughput, finetune, fp8, fp8-variants, harness or canary"),
    (["--only", "--smoke"], "error: --only '--smoke': use throughput, finetune, fp8, fp8-variants, harness or canary"),
    (["--smok"], "error: --smok: use --smoke and/or --only throughput|finetune|fp8|fp8-variants|harness|canary, then OUT"),
])
def test_a_wrong_argument_is_one_error_line(args, said, tmp_path):
    done = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert (done.returncode, done.stderr.strip(), done.stdout) == (2, said, "")
