"""Run a test module's `--worker` entry under Triton's interpreter in a fresh process.

The interpreter is chosen when Triton is imported, so the kernel cases of a module run in a child process
with TRITON_INTERPRET=1, batched into one call, and report back as one JSON line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


def interpreted_worker(path: str, *args: str, timeout_s: int = 900):
    """`python path --worker *args` with TRITON_INTERPRET=1; returns its last stdout line, parsed as JSON."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, path, "--worker", *args], env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
