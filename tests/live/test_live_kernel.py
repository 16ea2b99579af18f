"""``%ranks`` and ``%%ranks`` in a real IPython kernel, driven through jupyter_client as JupyterLab drives it:
live output, values side by side, push and pull, a hang explained, an interrupt, and no rank outliving the kernel.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

jupyter_client = pytest.importorskip("jupyter_client")
pytestmark = pytest.mark.timeout(400)


class Session:
    """One kernel; ``run(code)`` returns (stdout and stderr text, display texts, error or None)."""

    def __init__(self, cwd: str) -> None:
        self.km, self.kc = jupyter_client.manager.start_new_kernel(kernel_name="python3", cwd=cwd,
                                                                   startup_timeout=180)

    def run(self, code: str, timeout: float = 180) -> tuple[str, list[str], tuple[str, str] | None]:
        out, shown, errors = [], [], []

        def hook(msg: dict) -> None:
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":  # stdout and stderr, as a notebook shows them
                out.append(content["text"])
            elif kind in ("display_data", "execute_result"):
                shown.append(content["data"].get("text/plain", ""))
            elif kind == "error":
                errors.append((content["ename"], content["evalue"]))

        self.kc.execute_interactive(textwrap.dedent(code), timeout=timeout, output_hook=hook)
        return "".join(out), shown, errors[0] if errors else None


def _gone(pids: list[int], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids):
            return True
        time.sleep(0.1)
    return False


def test_magics_step_through_code_on_live_ranks_and_no_rank_outlives_the_kernel(tmp_path):
    session = Session(str(tmp_path))
    try:
        out, _, err = session.run("%load_ext dtlib\n%ranks start 2 --backend gloo --timeout 60", timeout=300)
        assert err is None and "2 live ranks on gloo" in out, (out, err)

        out, shown, err = session.run("%%ranks\nprint('hi from', rank)\ng = torch.tensor([rank * 1.0, 2.0])\ng")
        assert err is None and "[rank 0] hi from 0" in out and "[rank 1] hi from 1" in out
        assert shown == ["rank 0 │ tensor([0., 2.])\nrank 1 │ tensor([1., 2.])\n"
                         "rank 1 differs from rank 0 (by up to 1)"]
        _, shown, err = session.run("%%ranks\ndist.all_reduce(g)\ng")
        assert err is None and shown[0].endswith("the same on every rank")

        _, shown, err = session.run("base = 21\n%ranks push base\n%ranks pull g")
        assert err is None and shown[0].startswith("g:\nrank 0 │ tensor([1., 4.])")
        out, _, err = session.run("%%ranks\npid = base + rank\nimport os\nreal_pid = os.getpid()")
        assert err is None
        out, _, _ = session.run("%ranks pull pid real_pid\nprint(pid, type(g).__name__)")
        assert "[21, 22] list" in out
        out, shown, err = session.run("mine = %ranks pull --quiet pid\nboth = %ranks pull --quiet pid real_pid\n"
                                      "print(mine, pid, both[0])")
        assert err is None and shown == [] and "[21, 22] [21, 22] [21, 22]" in out  # returned, not shown

        _, _, err = session.run("%%ranks --timeout 3\nif rank == 0:\n    dist.all_reduce(torch.ones(4))\n")
        assert err is not None and err[0] == "WorkerTimeout", err
        assert "rank 0 waits in all_reduce #2 (float32[4])" in err[1] and "rank 0 is alone in collective #2" in err[1]

        threading.Timer(1.5, session.km.interrupt_kernel).start()
        _, _, err = session.run("%%ranks\nimport time\nkept = rank\nfor _ in range(600):\n    time.sleep(0.05)\n")
        assert err is not None and err[0] == "KeyboardInterrupt", err
        out, _, err = session.run("%ranks pull kept\nprint(kept)")
        assert err is None and "[0, 1]" in out

        out, _, _ = session.run("%ranks push nothing_here")  # IPython prints a UsageError, no traceback
        assert "UsageError: %ranks push: no variable named nothing_here" in out

        out, _, err = session.run("%ranks start 2 --backend gloo --timeout 60 --no-check")
        assert err is None and out.strip().endswith("(collectives not checked)"), (out, err)
        session.run("%%ranks\nimport os\nreal_pid = os.getpid()\n")
        pids = [int(p) for p in session.run("%ranks pull real_pid\nprint(*real_pid)")[0].split()]
        os.kill(session.km.provisioner.pid, signal.SIGKILL)  # the kernel dies: its ranks must not live on
        assert _gone(pids, within_s=20), f"ranks {pids} outlived their kernel"
    finally:
        session.kc.stop_channels()
        session.km.shutdown_kernel(now=True)


def test_ranks_left_open_stop_when_python_exits(tmp_path):
    script = "import dtlib\nranks = dtlib.LiveRanks(2, backend='gloo')\nprint(*ranks.run('import os\\nos.getpid()'))\n"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    pids = [int(p) for p in done.stdout.split()]
    assert len(pids) == 2 and _gone(pids, within_s=20)
