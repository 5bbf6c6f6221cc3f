"""Check built wheels: each ships only its own subpackage of the hyper_parallel namespace,
with py.typed, and no namespace-level __init__.py; every package has exactly one wheel."""

import sys
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _packages as pkgs


def check_wheel(wheel: str, layer: str) -> list[str]:
    problems = []
    names = zipfile.ZipFile(wheel).namelist()
    code = [n for n in names if not n.split("/")[0].endswith(".dist-info")]
    stray = [n for n in code if not n.startswith(f"{pkgs.NAMESPACE}/{layer}/")]
    if stray:
        problems.append(f"{wheel}: files outside {pkgs.NAMESPACE}/{layer}/: {stray}")
    if f"{pkgs.NAMESPACE}/{layer}/py.typed" not in names:
        problems.append(f"{wheel}: missing py.typed")
    if f"{pkgs.NAMESPACE}/__init__.py" in names:
        problems.append(f"{wheel}: ships {pkgs.NAMESPACE}/__init__.py (breaks the namespace)")
    return problems


def main(wheels: list[str]) -> int:
    layer_of = {p.wheel_name: p.layer for p in pkgs.packages()}
    problems = []
    built = sorted(Path(w).name.split("-")[0] for w in wheels)
    if built != sorted(layer_of):
        problems.append(f"wheels {built} are not one per package {sorted(layer_of)}")
    for wheel in wheels:
        dist = Path(wheel).name.split("-")[0]
        if dist not in layer_of:
            problems.append(f"{wheel}: unknown distribution {dist}")
        else:
            problems += check_wheel(wheel, layer_of[dist])
    for p in problems:
        print(p)
    print(f"checked {len(wheels)} wheel(s): {'FAILED' if problems else 'ok'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
