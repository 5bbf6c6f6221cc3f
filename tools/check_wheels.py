"""Check built wheels and sdists: each wheel ships only its own subpackage of the
hyper_parallel namespace, with py.typed, and no namespace-level __init__.py; every package has
exactly one wheel (and, where sdists are given, one sdist); every wheel and sdist carries the
repository's Apache-2.0 LICENSE, byte for byte."""

import sys
import tarfile
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
    licenses = [n for n in names if n.split("/")[0].endswith(".dist-info") and
                n.endswith("/licenses/LICENSE")]  # fmt: skip
    if not licenses:
        problems.append(f"{wheel}: no .dist-info/licenses/LICENSE")
    elif zipfile.ZipFile(wheel).read(licenses[0]) != LICENSE:
        problems.append(f"{wheel}: its LICENSE is not the repository's")
    return problems


def check_sdist(sdist: str) -> list[str]:
    with tarfile.open(sdist) as tar:
        top = Path(sdist).name.removesuffix(".tar.gz")
        try:
            member = tar.extractfile(f"{top}/LICENSE")
        except KeyError:
            member = None
        if member is None:
            return [f"{sdist}: no {top}/LICENSE"]
        if member.read() != LICENSE:
            return [f"{sdist}: its LICENSE is not the repository's"]
    return []


LICENSE = (pkgs.ROOT / "LICENSE").read_bytes()


def main(files: list[str]) -> int:
    layer_of = {p.wheel_name: p.layer for p in pkgs.packages()}
    wheels = [f for f in files if f.endswith(".whl")]
    sdists = [f for f in files if f.endswith(".tar.gz")]
    problems = []
    if sdists and sorted(Path(s).name.split("-")[0] for s in sdists) != sorted(layer_of):
        problems.append(f"sdists {sdists} are not one per package {sorted(layer_of)}")
    for sdist in sdists:
        problems += check_sdist(sdist)
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
    print(
        f"checked {len(wheels)} wheel(s), {len(sdists)} sdist(s): {'FAILED' if problems else 'ok'}"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
