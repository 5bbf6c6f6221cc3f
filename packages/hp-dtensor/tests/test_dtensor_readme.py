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
