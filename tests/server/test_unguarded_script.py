"""A script that starts an aggregator with worker processes but has no ``__main__`` guard.

Worker processes (and their forkserver) import the main script; without the guard each of
them would start an aggregator again, whose workers import the script again. The backend
refuses to start inside such an import and names the fix, so the nesting stops at one level.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_an_unguarded_script_is_told_to_add_the_guard(tmp_path: Path) -> None:
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent(f"""
        from murmura.cli import main
        main(["run", "--clients", "2", "--max-versions", "2", "--workers", "1", "-q",
              "--local-epochs", "1", "--out", {str(tmp_path / "out")!r}])
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        said = ""
        deadline = time.monotonic() + 60
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            said += line
            if "starts an aggregator with worker processes when it is imported" in line:
                break
        assert 'put that code under `if __name__ == "__main__":`' in said
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
