"""The README example runs as written and prints what it says."""

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_example_runs(tmp_path):
    block = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    script = tmp_path / "example.py"
    script.write_text(block)
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=180, check=True
    ).stdout.splitlines()
    assert out[0] == "0 (0, 2, 4, 6) [0, 2]"
    assert out[5] == "5 (1, 3, 5, 7) [5, 7]"
    assert len(out) == 8
