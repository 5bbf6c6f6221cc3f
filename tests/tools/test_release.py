"""The release policy's checks (tools/release.py), each on a throw-away clone of this repository.

Every test clones the repository's committed history into a temporary folder, copies the
current tools/ over it (so the checks under test are today's, whatever the commit checked out),
makes the change a developer would make, commits it there, and runs the check. Nothing touches
this checkout.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import release  # noqa: E402

pytestmark = pytest.mark.timeout(300)

MC2 = Path("packages/hp-mc2")
MC2_VERSION = MC2 / "src/hyper_parallel/mc2/_version.py"
MC2_SOURCE = MC2 / "src/hyper_parallel/mc2/__init__.py"


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, check=True, timeout=120
    ).stdout


@pytest.fixture
def clone(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(repo)], check=True, timeout=300)
    git(repo, "config", "user.email", "test@example.invalid")
    git(repo, "config", "user.name", "release test")
    return repo


def with_tools(repo: Path) -> Path:
    """Today's tools/ inside ``repo`` (untracked there), so the checks run on that tree."""
    shutil.copytree(
        ROOT / "tools",
        repo / "tools",
        dirs_exist_ok=True,
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    return repo / "tools" / "release.py"


def run(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    tool = with_tools(repo)
    return subprocess.run(
        [sys.executable, str(tool), *args], cwd=repo, capture_output=True, text=True, timeout=300
    )


def touch_source(repo: Path) -> None:
    path = repo / MC2_SOURCE
    path.write_text(path.read_text() + "\n# a change\n")


def add_entry(repo: Path, line: str) -> None:
    changelog = repo / MC2 / "CHANGELOG.md"
    text = changelog.read_text()
    changelog.write_text(text.replace("## Unreleased\n", f"## Unreleased\n\n{line}\n", 1))


def commit(repo: Path, message: str) -> None:
    git(repo, "add", "-A", "packages")
    git(repo, "commit", "-q", "-m", message)


def test_the_repository_itself_passes(clone: Path) -> None:
    proc = run(clone, "check")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "release checks: ok" in proc.stdout


def test_changed_package_with_unchanged_release_version_fails(clone: Path) -> None:
    # the release commit of hp-mc2 0.3.0, then a source change that keeps "0.3.0"
    rel = next(
        r
        for r in release.releases(release.pkgs.by_dist()["hp-mc2"]).values()
        if r.version == "0.3.0"
    )
    git(clone, "checkout", "-q", "-b", "throwaway", rel.commit)
    assert run(clone, "check").returncode == 0  # the release itself is consistent
    touch_source(clone)
    commit(clone, "change hp-mc2 but keep its release version")
    proc = run(clone, "check")
    assert proc.returncode == 1
    assert re.search(r"hp-mc2: src/ or pyproject.toml differ from release 0\.3\.0", proc.stdout)
    assert "tools/release.py open hp-mc2" in proc.stdout  # the fix is named
    # only hp-mc2 is named
    assert not re.search(r"^hp-(dtensor|models|kda-kernels|context-parallel):", proc.stdout, re.M)


def test_commit_that_does_not_move_the_dev_version_fails(clone: Path) -> None:
    touch_source(clone)
    commit(clone, "change hp-mc2 without a version")
    proc = run(clone, "check")
    assert proc.returncode == 1
    assert (
        "without changing packages/hp-mc2/src/hyper_parallel/mc2/_version.py and "
        "packages/hp-mc2/CHANGELOG.md" in proc.stdout
    )


def test_uncommitted_change_needs_bump_and_changelog(clone: Path) -> None:
    touch_source(clone)
    proc = run(clone, "check")
    assert proc.returncode == 1 and "hp-mc2: uncommitted changes" in proc.stdout
    before = (clone / MC2_VERSION).read_text()
    assert run(clone, "bump", "hp-mc2").returncode == 0
    after = (clone / MC2_VERSION).read_text()
    n_before = int(re.search(r"dev(\d+)", before).group(1))  # type: ignore[union-attr]
    assert f"dev{n_before + 1}" in after
    assert run(clone, "check").returncode == 1  # the changelog has not moved yet
    add_entry(clone, "- A change.")
    proc = run(clone, "check")
    assert proc.returncode == 0, proc.stdout
    commit(clone, "hp-mc2: a change, with its version and changelog")
    assert run(clone, "check").returncode == 0


def test_pin_to_a_version_never_released_fails(clone: Path) -> None:
    pyproject = clone / MC2 / "pyproject.toml"
    text = pyproject.read_text()
    pin = r'"hp-dtensor>=0\.[0-9.]+,<0\.\d+"'
    assert re.search(pin, text)
    pyproject.write_text(re.sub(pin, '"hp-dtensor>=0.9,<0.10"', text))
    proc = run(clone, "check")
    assert proc.returncode == 1
    assert "hp-mc2 requires hp-dtensor>=0.9,<0.10, but no hp-dtensor release" in proc.stdout


def test_dev_version_without_unreleased_section_fails(clone: Path) -> None:
    changelog = clone / MC2 / "CHANGELOG.md"
    changelog.write_text(changelog.read_text().replace("## Unreleased\n", "", 1))
    proc = run(clone, "check")
    assert proc.returncode == 1
    assert "the first section must be '## Unreleased'" in proc.stdout


def test_editing_released_notes_fails(clone: Path) -> None:
    changelog = clone / MC2 / "CHANGELOG.md"
    text = changelog.read_text()
    assert "## 0.3.0 — " in text
    changelog.write_text(
        text.replace("## 0.3.0 — 2026-12-01\n", "## 0.3.0 — 2026-12-01\n\n- Later.\n")
    )
    proc = run(clone, "check")
    assert proc.returncode == 1
    assert "hp-mc2: the CHANGELOG section of release 0.3.0 differs" in proc.stdout


def test_prepare_then_open_round_trip(clone: Path) -> None:
    changelog = clone / MC2 / "CHANGELOG.md"
    # an empty Unreleased section cannot be released
    head, rest = changelog.read_text().split(release.UNRELEASED + "\n", 1)
    changelog.write_text(f"{head}{release.UNRELEASED}\n\n## {rest.split(chr(10) + '## ', 1)[1]}")
    proc = run(clone, "prepare", "hp-mc2")
    assert proc.returncode == 2 and "is empty" in proc.stderr
    add_entry(clone, "- A fix.")
    touch_source(clone)
    assert run(clone, "bump", "hp-mc2").returncode == 0
    commit(clone, "hp-mc2: a fix")
    dev = re.search(r'"(.*)"', (clone / MC2_VERSION).read_text()).group(1)  # type: ignore[union-attr]
    proc = run(clone, "prepare", "hp-mc2", "--date", "2030-01-02")
    assert proc.returncode == 0, proc.stderr
    version = dev.split(".dev")[0]
    assert proc.stdout.strip() == version
    assert f'"{version}"' in (clone / MC2_VERSION).read_text()
    assert f"## {version} — 2030-01-02\n" in changelog.read_text()
    commit(clone, f"Release hp-mc2 {version}")
    assert run(clone, "check").returncode == 0
    assert version in {r.version for r in _releases(clone, "hp-mc2")}
    # releasing the same version again is refused
    assert run(clone, "prepare", "hp-mc2").returncode == 2
    proc = run(clone, "open", "hp-mc2")
    assert proc.returncode == 0
    major, minor, patch = (int(x) for x in version.split("."))
    assert proc.stdout.strip() == f"{major}.{minor}.{patch + 1}.dev0"
    assert changelog.read_text().split("\n## ", 1)[1].startswith("Unreleased\n")
    commit(clone, "hp-mc2: open the next version")
    assert run(clone, "check").returncode == 0


def test_export_builds_the_release_tree(clone: Path, tmp_path: Path) -> None:
    dest = tmp_path / "exported"
    proc = run(clone, "export", "hp-dtensor", "0.2.0", str(dest))
    assert proc.returncode == 0, proc.stderr
    version = (dest / "packages/hp-dtensor/src/hyper_parallel/dtensor/_version.py").read_text()
    assert '"0.2.0"' in version
    # 0.2.0 predates consistency mode: the very thing a lowest-sibling test must catch
    assert not (dest / "packages/hp-dtensor/src/hyper_parallel/dtensor/consistency.py").exists()


def _releases(repo: Path, dist: str) -> list[release.Release]:
    out = run(repo, "status").stdout
    assert dist in out
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            (
                "import sys; sys.path.insert(0, 'tools'); import release; "
                f"print(' '.join(release.releases(release.pkgs.by_dist()[{dist!r}])))"
            ),
        ],
        cwd=repo,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return [release.Release(dist, v, "") for v in proc.stdout.split()]
