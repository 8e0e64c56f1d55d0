"""Each package's wheel takes its version from its own tags (`<dist>-vX.Y.Z`), never a sibling's."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(path.parent for path in (ROOT / "packages").glob("*/pyproject.toml"))


def git(repo: Path, *args: str) -> str:
    identity = ["-c", "user.name=versions-test", "-c", "user.email=versions-test@example.invalid"]
    return subprocess.run(["git", *identity, *args], cwd=repo, check=True, text=True,
                          capture_output=True).stdout.strip()


def dist_name(package_dir: Path) -> str:
    return tomllib.loads((package_dir / "pyproject.toml").read_text())["project"]["name"]


def built_version(package_dir: Path, out: Path) -> str:
    """Build the package's wheel and read the version from the wheel's own metadata."""
    result = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out),
         str(package_dir)],
        capture_output=True, text=True,
    )
    assert result.returncode == 0, f"building {package_dir.name} failed:\n{result.stderr[-3000:]}"
    (wheel,) = out.glob(f"{dist_name(package_dir).replace('-', '_')}-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(name for name in archive.namelist() if name.endswith(".dist-info/METADATA"))
        for line in archive.read(metadata).decode().splitlines():
            if line.startswith("Version: "):
                return line.removeprefix("Version: ")
    raise AssertionError(f"no Version in {wheel}")


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A throwaway clone of this repository, where tags can be made freely."""
    repo = tmp_path_factory.mktemp("clone") / "repo"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(repo)], check=True)
    for tag in git(repo, "tag", "--list").split():
        git(repo, "tag", "--delete", tag)
    return repo


@pytest.mark.parametrize("package_dir", PACKAGES, ids=lambda path: path.name)
def test_version_comes_from_own_tag_not_a_siblings(clone: Path, package_dir: Path,
                                                   tmp_path: Path) -> None:
    name = dist_name(package_dir)
    relative = package_dir.relative_to(ROOT)
    git(clone, "tag", f"{name}-v1.4.2")
    git(clone, "tag", "zz-sibling-v9.9.9")  # a sibling's newer tag on the same commit
    assert built_version(clone / relative, tmp_path / "tagged") == "1.4.2"

    # One commit later a sibling is released again; this package's version still derives from
    # its own last tag (next patch, dev distance 1), not from the sibling's 9.9.9 or 10.0.0.
    git(clone, "commit", "--quiet", "--allow-empty", "-m", "a later change")
    git(clone, "tag", "zz-sibling-v10.0.0")
    later = built_version(clone / relative, tmp_path / "later")
    assert later.startswith("1.4.3.dev1+g"), later
    git(clone, "reset", "--quiet", "--hard", "HEAD~1")
    for tag in (f"{name}-v1.4.2", "zz-sibling-v9.9.9", "zz-sibling-v10.0.0"):
        git(clone, "tag", "--delete", tag)
