"""The scheduler layer is plain Python: importing it pulls in neither torch nor an event loop."""

import subprocess
import sys


def test_scheduler_imports_without_torch_or_trio():
    code = ("import sys, engine.sched.scheduler, engine.sched.block_manager; "
            "heavy = [m for m in ('torch', 'trio', 'anyio') if m in sys.modules]; "
            "assert not heavy, heavy")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
