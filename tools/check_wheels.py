"""Check built wheels: each ships only its own subpackage of the hyper_parallel namespace,
with py.typed, and no namespace-level __init__.py."""

import sys
import zipfile
from pathlib import Path

LAYER = {
    "hp_dtensor": "dtensor",
    "hp_mc2": "mc2",
    "hp_context_parallel": "context_parallel",
    "hp_kda_kernels": "kda",
}


def main(wheels: list[str]) -> int:
    problems = []
    for wheel in wheels:
        dist = Path(wheel).name.split("-")[0]
        layer = LAYER.get(dist)
        if layer is None:
            problems.append(f"{wheel}: unknown distribution {dist}")
            continue
        names = zipfile.ZipFile(wheel).namelist()
        code = [n for n in names if not n.split("/")[0].endswith(".dist-info")]
        stray = [n for n in code if not n.startswith(f"hyper_parallel/{layer}/")]
        if stray:
            problems.append(f"{wheel}: files outside hyper_parallel/{layer}/: {stray}")
        if f"hyper_parallel/{layer}/py.typed" not in names:
            problems.append(f"{wheel}: missing py.typed")
        if "hyper_parallel/__init__.py" in names:
            problems.append(f"{wheel}: ships hyper_parallel/__init__.py (breaks the namespace)")
    for p in problems:
        print(p)
    print(f"checked {len(wheels)} wheel(s): {'FAILED' if problems else 'ok'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
