"""Each package's version lives in its own pyproject.toml, so every clone builds the released
numbers; releasing one package (tools/release.py) changes that package alone."""

from __future__ import annotations

import datetime
import importlib.util
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(path.parent for path in (ROOT / "packages").glob("*/pyproject.toml"))


def project(package_dir: Path) -> dict:
    return tomllib.loads((package_dir / "pyproject.toml").read_text())["project"]


def built_version(package_dir: Path, out: Path) -> str:
    """Build the package's wheel and read the version from the wheel's own metadata."""
    result = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out),
         str(package_dir)],
        capture_output=True, text=True,
    )
    assert result.returncode == 0, f"building {package_dir.name} failed:\n{result.stderr[-3000:]}"
    (wheel,) = out.glob(f"{project(package_dir)['name'].replace('-', '_')}-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(name for name in archive.namelist() if name.endswith(".dist-info/METADATA"))
        for line in archive.read(metadata).decode().splitlines():
            if line.startswith("Version: "):
                return line.removeprefix("Version: ")
    raise AssertionError(f"no Version in {wheel}")


@pytest.mark.parametrize("package_dir", PACKAGES, ids=lambda path: path.name)
def test_the_wheel_reports_the_released_version_written_in_the_repository(
        package_dir: Path, tmp_path: Path) -> None:
    written = project(package_dir)["version"]
    assert not Version(written).is_devrelease and not Version(written).local
    assert built_version(package_dir, tmp_path) == written
    changelog = (package_dir / "CHANGELOG.md").read_text()
    assert f"\n## {written} — " in changelog, "the CHANGELOG has a section for the release"


@pytest.mark.parametrize("package_dir", PACKAGES, ids=lambda path: path.name)
def test_siblings_are_required_within_their_released_minor_version(package_dir: Path) -> None:
    versions = {project(path)["name"]: Version(project(path)["version"]) for path in PACKAGES}
    declared = [*project(package_dir).get("dependencies", []),
                *(item for extra in project(package_dir).get("optional-dependencies", {}).values()
                  for item in extra)]
    for requirement in map(Requirement, declared):
        if requirement.name in versions:
            released = versions[requirement.name]
            assert requirement.specifier.contains(released), (requirement, released)
            assert not requirement.specifier.contains(Version(f"{released.major}."
                                                              f"{released.minor + 1}.0")), \
                f"{requirement} admits the next minor version of {requirement.name}"


def _release_module():
    spec = importlib.util.spec_from_file_location("release", ROOT / "tools" / "release.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_releasing_one_package_changes_that_package_alone(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(repo)], check=True)
    release = _release_module()
    release.ROOT = repo
    target = repo / "packages" / "tokenspan"
    changelog = target / "CHANGELOG.md"
    changelog.write_text(changelog.read_text().replace(
        "## Unreleased\n", "## Unreleased\n\n- A change worth a release.\n", 1))
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t.invalid",
                    "commit", "--quiet", "-am", "a change"], check=True)
    old = Version(project(target)["version"])
    new = f"{old.major}.{old.minor}.{old.micro + 1}"
    release.release("tokenspan", new, build=False, today=datetime.date(2027, 1, 2))

    changed = subprocess.run(["git", "-C", str(repo), "diff", "--name-only"], check=True,
                             capture_output=True, text=True).stdout.split()
    assert sorted(changed) == ["packages/tokenspan/CHANGELOG.md",
                               "packages/tokenspan/pyproject.toml"]
    assert project(target)["version"] == new
    text = changelog.read_text()
    assert text.index("## Unreleased\n") < text.index(f"## {new} — 2027-01-02\n\n"
                                                      "- A change worth a release.")
    with pytest.raises(SystemExit, match="already"):
        release.release("tokenspan", str(old), build=False)
    with pytest.raises(SystemExit, match="nothing under"):
        release.release("tokenspan", f"{old.major}.{old.minor + 1}.0", build=False)
    with pytest.raises(SystemExit, match="no package 'tokenspam'"):
        release.release("tokenspam", "9.0.0", build=False)
