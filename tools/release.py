#!/usr/bin/env python3
"""Versions that identify code: the release policy of RELEASING.md, as checks and commands.

A release of a package is the first commit whose ``_version.py`` says exactly ``X.Y.Z``; between
releases the version is ``X.Y.Z.devN``. Everything here reads git history, nothing needs a tag.

    python3 tools/release.py status              every package: version, last release, changed?
    python3 tools/release.py check               the lint rules (the lint session runs this)
    python3 tools/release.py lowest DIST         the lowest release of each sibling DIST admits
    python3 tools/release.py export DIST VERSION DEST   DIST's files at that release, into DEST
    python3 tools/release.py bump DIST           devN -> devN+1 (the commit that changes DIST)
    python3 tools/release.py prepare DIST [--version X.Y.Z] [--date YYYY-MM-DD]
                                                 set the release version, date the changelog
    python3 tools/release.py open DIST           the next development version + "## Unreleased"

``nox -s release -- DIST`` runs check, prepare, the sdist and wheel build and ``twine check
--strict``; with ``--commit`` it also commits the release, tags it ``DIST==X.Y.Z`` and commits the
next development version (RELEASING.md). Standard library only.
"""

from __future__ import annotations

import argparse
import datetime
import io
import re
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _packages as pkgs

ROOT = pkgs.ROOT
# the release commit that started this policy: every later commit is held to it
POLICY_START = "d0871ed24024c53c6e84ecb912e21f8c7a0c409d"
DATED = re.compile(r"## (\d+\.\d+\.\d+) — (\d{4}-\d{2}-\d{2})")
UNRELEASED = "## Unreleased"


class ReleaseError(RuntimeError):
    pass


def git(*args: str, check: bool = True) -> str:
    proc = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    if check and proc.returncode != 0:
        raise ReleaseError(f"git {' '.join(args)}: {proc.stderr.strip()}")
    return proc.stdout


def have_history() -> bool:
    try:
        return git("rev-parse", "--is-inside-work-tree", check=False).strip() == "true"
    except (OSError, subprocess.SubprocessError):
        return False


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def shipped_paths(pkg: pkgs.Package) -> list[str]:
    """What a release of ``pkg`` is made of: its sources and its metadata."""
    return [rel(pkg.src), rel(pkg.root / "pyproject.toml")]


@dataclass(frozen=True)
class Release:
    dist: str
    version: str
    commit: str


def _blobs(specs: list[str]) -> list[str | None]:
    """The text of each ``commit:path`` in ``specs``, read by one ``git cat-file --batch``
    (one git process instead of one per commit); None where git has no such object."""
    if not specs:
        return []
    proc = subprocess.run(["git", "cat-file", "--batch"], cwd=ROOT, capture_output=True,
                          input=("\n".join(specs) + "\n").encode(), timeout=120)  # fmt: skip
    if proc.returncode != 0:
        raise ReleaseError(f"git cat-file --batch: {proc.stderr.decode().strip()}")
    out, pos, texts = proc.stdout, 0, []
    for _ in specs:
        end = out.index(b"\n", pos)
        header = out[pos:end].split()  # "<sha> <type> <size>", or "<spec> missing"
        pos = end + 1
        if len(header) != 3 or not header[2].isdigit():
            texts.append(None)
            continue
        size = int(header[2])
        texts.append(out[pos : pos + size].decode("utf-8", errors="replace"))
        pos += size + 1  # the contents, then a newline
    return texts


# releases() by (dist, HEAD): one check asks for a package's releases many times; history
# up to a given HEAD never changes, and a new commit is a new key
_RELEASES: dict[tuple[str, str], dict[str, Release]] = {}


def releases(pkg: pkgs.Package) -> dict[str, Release]:
    """Every release of ``pkg`` in history: version -> the first commit that says it."""
    head = git("rev-parse", "HEAD").strip()
    if (pkg.dist, head) in _RELEASES:
        return dict(_RELEASES[pkg.dist, head])
    found: dict[str, Release] = {}
    path = rel(pkg.version_file)
    commits = git("log", "--reverse", "--format=%H", head, "--", path).split()
    for commit, text in zip(commits, _blobs([f"{c}:{path}" for c in commits])):
        if text is None:
            continue
        try:
            version = pkgs.parse_version_file(text, pkg.dist)
        except ValueError:
            continue
        if not pkgs.is_dev(version) and version not in found:
            found[version] = Release(pkg.dist, version, commit)
    _RELEASES[pkg.dist, head] = found
    return dict(found)


def spec_bounds(spec: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    m = re.fullmatch(r">=\s*([0-9.]+)\s*,\s*<\s*([0-9.]+)", spec)
    if not m:
        raise ReleaseError(f"sibling requirement {spec!r} is not a '>=A.B,<C.D' range")
    low, high = (tuple(int(x) for x in v.split(".")) for v in m.groups())
    return low, high


def lowest_admitted(pkg: pkgs.Package) -> dict[str, Release]:
    """For each hp-* sibling ``pkg`` requires, the lowest release its range admits."""
    known = pkgs.by_dist()
    chosen: dict[str, Release] = {}
    for sib, spec in pkg.pins:
        low, high = spec_bounds(spec)
        found = releases(known[sib]).values()
        admitted = sorted(
            (r for r in found if low <= pkgs.release_tuple(r.version) < high),
            key=lambda r: pkgs.release_tuple(r.version),
        )
        if not admitted:
            raise ReleaseError(
                f"{pkg.dist} requires {sib}{spec}, but no {sib} release in history is in that "
                f"range: release {sib} first (RELEASING.md), or pin a released version"
            )
        chosen[sib] = admitted[0]
    return chosen


def changed_since(commit: str, paths: list[str]) -> bool:
    """Whether the working tree differs from ``commit`` under ``paths`` (untracked files too)."""
    if subprocess.run(
        ["git", "diff", "--quiet", commit, "--", *paths], cwd=ROOT, timeout=120
    ).returncode:
        return True
    untracked = git("ls-files", "--others", "--exclude-standard", "--", *paths).strip()
    return bool(untracked)


def same_code(pkg: pkgs.Package, commit: str) -> bool:
    """Whether ``pkg`` ships the same files now as at ``commit``, its version aside."""
    paths = [*shipped_paths(pkg), f":(exclude){rel(pkg.version_file)}"]
    return not changed_since(commit, paths)


def changelog_sections(pkg: pkgs.Package) -> list[str]:
    text = (pkg.root / "CHANGELOG.md").read_text()
    return [line.rstrip() for line in text.splitlines() if line.startswith("## ")]


# ----------------------------------------------------------------------------------- the checks


def check_changelog(pkg: pkgs.Package) -> list[str]:
    version = pkg.version_text()
    heads = changelog_sections(pkg)
    where = f"{pkg.dist}: CHANGELOG.md"
    if not heads:
        return [f"{where} has no '## ' section"]
    problems = []
    for head in heads:
        if head != UNRELEASED and not DATED.fullmatch(head):
            problems.append(
                f"{where}: section {head!r} is neither '{UNRELEASED}' nor '## X.Y.Z — YYYY-MM-DD'"
            )
    if heads.count(UNRELEASED) > (1 if heads[0] == UNRELEASED else 0):
        problems.append(f"{where}: '{UNRELEASED}' must be the first section, and only once")
    if pkgs.is_dev(version) and heads[0] != UNRELEASED:
        problems.append(
            f"{where}: version {version} is a development version, so the first "
            f"section must be '{UNRELEASED}' (python3 tools/release.py open "
            f"{pkg.dist} writes it)"
        )
    if not pkgs.is_dev(version):
        m = DATED.fullmatch(heads[0])
        if not m or m.group(1) != version:
            problems.append(
                f"{where}: version {version} is a release, so the first section "
                f"must be '## {version} — YYYY-MM-DD'"
            )
    return problems


def check_version(pkg: pkgs.Package) -> list[str]:
    """A release version names exactly the code of its release commit; a .dev version is
    ahead of every release."""
    version = pkg.version_text()
    found = releases(pkg)
    if pkgs.is_dev(version):
        newer = [v for v in found if pkgs.release_tuple(v) >= pkgs.release_tuple(version)]
        if newer:
            return [
                f"{pkg.dist}: development version {version} is not ahead of release "
                f"{max(newer, key=pkgs.release_tuple)}: open a higher one "
                f"(python3 tools/release.py open {pkg.dist})"
            ]
        return []
    release = found.get(version)
    if release is None:  # being prepared in this working tree, not committed yet
        return []
    if changed_since(release.commit, shipped_paths(pkg)):
        return [
            f"{pkg.dist}: src/ or pyproject.toml differ from release {version} (commit "
            f"{release.commit[:10]}) while _version.py still says {version}: open the next "
            f"development version with 'python3 tools/release.py open {pkg.dist}' and "
            "describe the change under '## Unreleased' in CHANGELOG.md"
        ]
    return []


def section(text: str, version: str) -> str | None:
    """The body of ``## version — date`` in a CHANGELOG text (None if it has none)."""
    for block in text.split("\n## ")[1:]:
        m = DATED.fullmatch("## " + block.split("\n", 1)[0].rstrip())
        if m and m.group(1) == version:
            return block.strip()
    return None


def check_released_notes(pkg: pkgs.Package) -> list[str]:
    """A released section of the CHANGELOG reads as it did in its release commit (releases made
    under this policy; the earlier ones were rewritten once when it began)."""
    problems = []
    text = (pkg.root / "CHANGELOG.md").read_text()
    path = rel(pkg.root / "CHANGELOG.md")
    for r in releases(pkg).values():
        ancestor = (
            subprocess.run(
                ["git", "merge-base", "--is-ancestor", POLICY_START, r.commit], cwd=ROOT, timeout=60
            ).returncode
            == 0
        )
        if not ancestor:
            continue
        then = section(git("show", f"{r.commit}:{path}"), r.version)
        if then is not None and section(text, r.version) != then:
            problems.append(
                f"{pkg.dist}: the CHANGELOG section of release {r.version} differs "
                f"from its release commit {r.commit[:10]}: released notes are not "
                "edited; say it under '## Unreleased'"
            )
    return problems


def check_history(pkg: pkgs.Package) -> list[str]:
    """Since the policy started, every commit that changes what ``pkg`` ships also moves its
    version and its CHANGELOG; so does the working tree against HEAD."""
    if git("cat-file", "-t", POLICY_START, check=False).strip() != "commit":
        return []  # a shallow or foreign history: nothing to hold it to
    problems = []
    shipped = shipped_paths(pkg)
    version_file, changelog = rel(pkg.version_file), rel(pkg.root / "CHANGELOG.md")
    for commit in git("log", "--format=%H", f"{POLICY_START}..HEAD", "--", *shipped).split():
        touched = set(git("diff-tree", "--no-commit-id", "--name-only", "-r", commit).split())
        missing = [p for p in (version_file, changelog) if p not in touched]
        if missing:
            subject = git("log", "-1", "--format=%s", commit).strip()
            problems.append(
                f"{pkg.dist}: commit {commit[:10]} ({subject[:60]!r}) changes "
                f"what the package ships without changing {' and '.join(missing)}"
            )
    if changed_since("HEAD", shipped) and not (
        changed_since("HEAD", [version_file]) and changed_since("HEAD", [changelog])
    ):
        problems.append(
            f"{pkg.dist}: uncommitted changes to src/ or pyproject.toml: move the "
            f"version in the same commit ('python3 tools/release.py bump {pkg.dist}') "
            "and add a line under '## Unreleased' in CHANGELOG.md"
        )
    return problems


def check_pins(pkg: pkgs.Package) -> list[str]:
    try:
        lowest_admitted(pkg)
    except ReleaseError as exc:
        return [str(exc)]
    return []


def check() -> list[str]:
    problems: list[str] = []
    for pkg in pkgs.packages():
        try:
            problems += check_changelog(pkg)
            if have_history():
                problems += check_version(pkg) + check_history(pkg) + check_pins(pkg)
                problems += check_released_notes(pkg)
        except (ValueError, ReleaseError) as exc:
            problems.append(str(exc))
    return problems


# --------------------------------------------------------------------------------- the commands


def write_version(pkg: pkgs.Package, version: str) -> None:
    text = pkg.version_file.read_text()
    pkg.version_file.write_text(
        re.sub(r'__version__\s*=\s*"[^"]*"', f'__version__ = "{version}"', text, count=1)
    )


def bump(pkg: pkgs.Package) -> str:
    version = pkg.version_text()
    m = pkgs.VERSION.fullmatch(version)
    assert m is not None
    if m.group(4) is None:
        raise ReleaseError(f"{pkg.dist} is at release {version}: 'open' a development version")
    new = f"{'.'.join(m.groups()[:3])}.dev{int(m.group(4)) + 1}"
    write_version(pkg, new)
    return new


def open_next(pkg: pkgs.Package) -> str:
    version = pkg.version_text()
    if pkgs.is_dev(version):
        raise ReleaseError(f"{pkg.dist} is already at development version {version}")
    major, minor, patch = pkgs.release_tuple(version)
    new = f"{major}.{minor}.{patch + 1}.dev0"
    write_version(pkg, new)
    path = pkg.root / "CHANGELOG.md"
    text = path.read_text()
    first = text.find("\n## ")
    head, rest = (text, "") if first < 0 else (text[: first + 1], text[first + 1 :])
    path.write_text(f"{head.rstrip()}\n\n{UNRELEASED}\n\n{rest}")
    return new


def prepare(pkg: pkgs.Package, version: str | None, date: str | None) -> str:
    current = pkg.version_text()
    if not pkgs.is_dev(current):
        raise ReleaseError(f"{pkg.dist} is at release {current} already")
    version = version or current.split(".dev")[0]
    if not pkgs.VERSION.fullmatch(version) or pkgs.is_dev(version):
        raise ReleaseError(f"release version {version!r} must be X.Y.Z")
    if version in releases(pkg):
        raise ReleaseError(f"{pkg.dist} {version} was released already")
    last = max(releases(pkg), key=pkgs.release_tuple, default=None)
    if last and pkgs.release_tuple(version) <= pkgs.release_tuple(last):
        raise ReleaseError(f"{pkg.dist}: {version} is not above the last release {last}")
    path = pkg.root / "CHANGELOG.md"
    text = path.read_text()
    if UNRELEASED + "\n" not in text:
        raise ReleaseError(f"{rel(path)} has no '{UNRELEASED}' section to date")
    body = text.split(UNRELEASED + "\n", 1)[1].split("\n## ", 1)[0]
    if not body.strip():
        raise ReleaseError(f"{rel(path)}: the '{UNRELEASED}' section is empty: say what changed")
    date = date or datetime.date.today().isoformat()
    path.write_text(text.replace(UNRELEASED + "\n", f"## {version} — {date}\n", 1))
    write_version(pkg, version)
    return version


def export(pkg: pkgs.Package, version: str, dest: Path) -> Path:
    """``pkg``'s directory as it was at release ``version``, unpacked under ``dest``; returns
    the package directory there (buildable: pyproject, sources, README, LICENSE if it had one)."""
    release = releases(pkg).get(version)
    if release is None:
        raise ReleaseError(f"{pkg.dist} {version} is not a release in history")
    archive = ["git", "archive", "--format=tar", release.commit, rel(pkg.root)]
    blob = subprocess.run(archive, cwd=ROOT, capture_output=True, check=True, timeout=120).stdout
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        tar.extractall(dest, filter="data")
    return dest / rel(pkg.root)


def status() -> None:
    for pkg in pkgs.in_dependency_order():
        found = releases(pkg) if have_history() else {}
        last = max(found, key=pkgs.release_tuple, default=None)
        changed = (
            "?"
            if last is None
            else ("same code" if same_code(pkg, found[last].commit) else "changed")
        )
        lowest = ""
        if pkg.pins:
            try:
                lowest = ", ".join(f"{r.dist}=={r.version}" for r in lowest_admitted(pkg).values())
            except ReleaseError as exc:
                lowest = f"({exc})"
        print(
            f"{pkg.dist:<20} {pkg.version_text():<12} last release {last or '-':<7} "
            f"{changed:<9} lowest siblings: {lowest or '-'}"
        )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("status")
    sub.add_parser("check")
    for name in ("lowest", "bump", "open"):
        sub.add_parser(name).add_argument("dist")
    exp = sub.add_parser("export")
    exp.add_argument("dist")
    exp.add_argument("version")
    exp.add_argument("dest", type=Path)
    prep = sub.add_parser("prepare")
    prep.add_argument("dist")
    prep.add_argument("--version")
    prep.add_argument("--date")
    args = parser.parse_args(argv)
    known = pkgs.by_dist()
    if getattr(args, "dist", None) and args.dist not in known:
        parser.error(f"unknown package {args.dist!r}; choose from {sorted(known)}")
    try:
        if args.cmd == "status":
            status()
        elif args.cmd == "check":
            found = check()
            for p in found:
                print(p)
            print("release checks:", "FAILED" if found else "ok")
            return 1 if found else 0
        elif args.cmd == "lowest":
            for r in lowest_admitted(known[args.dist]).values():
                print(f"{r.dist} {r.version} {r.commit}")
        elif args.cmd == "export":
            print(export(known[args.dist], args.version, args.dest))
        elif args.cmd == "bump":
            print(bump(known[args.dist]))
        elif args.cmd == "open":
            print(open_next(known[args.dist]))
        elif args.cmd == "prepare":
            print(prepare(known[args.dist], args.version, args.date))
    except ReleaseError as exc:
        print(f"release: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
