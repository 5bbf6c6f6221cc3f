"""The README example runs as written and prints what it says."""

from pathlib import Path

from hyper_parallel.dtensor.testing import run_markdown_example

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_example_runs():
    out = run_markdown_example(README).splitlines()
    assert out[0] == "0 (0, 2, 4, 6) [0, 2]"
    assert out[5] == "5 (1, 3, 5, 7) [5, 7]"
    assert len(out) == 8


def test_gloo_connection_messages_are_removed_even_when_interleaved():
    from hyper_parallel.dtensor.testing import strip_gloo_connected

    msg = (
        "[Gloo] Rank {} is connected to 1 peer ranks. Expected number of connected peer ranks is"
        " : 1"
    )
    # as torch 2.10 wrote it from two ranks at once: one message split by the other
    split = "[Gloo] Rank " + msg.format(0) + "\n" + msg.format(1)[len("[Gloo] Rank ") :] + "\n"
    text = split + "0 (0, 2, 4, 6) [0, 2]\n" + msg.format(1) + "\n1 (1, 3) [1]\n"
    assert strip_gloo_connected(text) == "0 (0, 2, 4, 6) [0, 2]\n1 (1, 3) [1]\n"
    # inside one of the example's own lines
    assert strip_gloo_connected("2 (0," + msg.format(3) + "\n 2)\n") == "2 (0, 2)\n"
    # the example's own text is never touched
    assert strip_gloo_connected("Rank 3 is connected\n") == "Rank 3 is connected\n"


_C_PRINTING = """
import ctypes
from hyper_parallel.dtensor.testing import run_distributed


def shout(lines):
    import time
    import torch.distributed as dist

    libc = ctypes.CDLL(None)
    for i in range(lines):  # C stdio in pieces, as gloo's C++ prints its lines
        libc.printf(b"rank %d ", dist.get_rank())
        time.sleep(0.001)  # a line takes a while: the other rank's pieces overlap it
        libc.printf(b"line %04d ", i)
        time.sleep(0.001)
        libc.printf(b"%s\\n", b"x" * 60)
    return dist.get_rank()


if __name__ == "__main__":
    # 2 ranks x 60 lines: 4.7 KB per rank, more than a pipe's 4 KiB block buffer
    assert run_distributed(shout, 2, 60) == [0, 1]
    print("done", flush=True)
"""


def test_ranks_c_output_arrives_in_whole_lines_before_the_callers_own(tmp_path):
    """What ranks print from C/C++ (torch 2.10's gloo does) comes out line by line, never cut
    mid-line by another rank's output, and before what the caller prints after the run."""
    import re
    import subprocess
    import sys

    script = tmp_path / "shout.py"
    script.write_text(_C_PRINTING)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    from hyper_parallel.dtensor.testing import strip_gloo_connected

    lines = strip_gloo_connected(done.stdout).splitlines()  # torch 2.10's own, whole lines
    assert lines[-1] == "done"
    pattern = re.compile(r"rank [01] line \d{4} x{60}")
    bad = [ln for ln in lines[:-1] if not pattern.fullmatch(ln)]
    assert not bad, bad[:5]
    assert len(lines) == 2 * 60 + 1


def test_readme_consistency_example_names_the_field_on_every_rank():
    assert run_markdown_example(README, index=1).splitlines()[-1] == "['x', 'x']"
