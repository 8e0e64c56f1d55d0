"""Release one package of the monorepo, leaving the others as they are.

    python tools/release.py PACKAGE VERSION [--no-build]

Sets `version` in `packages/PACKAGE/pyproject.toml`, dates the CHANGELOG's `## Unreleased`
section under `## VERSION — YYYY-MM-DD` (a fresh, empty `## Unreleased` above it), and builds
the wheel and sdist into `dist/PACKAGE/`. Refuses a version that is not above the current one
and a release with nothing under `## Unreleased`. Versions live in the repository (not in tags),
so every clone builds the released numbers; commit the change and tag it `PACKAGE-vVERSION`.
`nox -s "release(package='PACKAGE')" -- VERSION` runs it with `build` installed.
"""

from __future__ import annotations

import argparse
import datetime
import re
import subprocess
import sys
from pathlib import Path

from packaging.version import InvalidVersion, Version

ROOT = Path(__file__).resolve().parents[1]
VERSION_LINE = re.compile(r'^version = "([^"]+)"$', re.M)
UNRELEASED = "## Unreleased\n"


def current_version(pyproject: str) -> Version:
    found = VERSION_LINE.search(pyproject)
    if found is None:
        raise SystemExit("no `version = \"...\"` line in [project]")
    return Version(found.group(1))


def dated_changelog(changelog: str, version: Version, today: datetime.date) -> str:
    """The CHANGELOG with its Unreleased section moved under `version`, dated `today`."""
    start = changelog.find(UNRELEASED)
    if start < 0:
        raise SystemExit("the CHANGELOG has no `## Unreleased` section")
    body_start = start + len(UNRELEASED)
    following = changelog.find("\n## ", body_start)
    end = len(changelog) if following < 0 else following + 1
    body = changelog[body_start:end].strip("\n")
    if not body:
        raise SystemExit("nothing under `## Unreleased`: nothing to release")
    return (f"{changelog[:start]}{UNRELEASED}\n## {version} — {today.isoformat()}\n\n"
            f"{body}\n\n{changelog[end:]}").rstrip("\n") + "\n"


def release(package: str, version: str, build: bool = True,
            today: datetime.date | None = None) -> None:
    package_dir = ROOT / "packages" / package
    if not (package_dir / "pyproject.toml").is_file():
        known = sorted(path.parent.name for path in (ROOT / "packages").glob("*/pyproject.toml"))
        raise SystemExit(f"no package {package!r} (packages: {', '.join(known)})")
    try:
        new = Version(version)
    except InvalidVersion:
        raise SystemExit(f"{version!r} is not a version (e.g. 0.1.1)") from None
    if new.is_prerelease or new.is_devrelease or new.local:
        raise SystemExit(f"{version}: a release is a plain X.Y.Z")
    pyproject_path = package_dir / "pyproject.toml"
    pyproject = pyproject_path.read_text()
    old = current_version(pyproject)
    if new <= old:
        raise SystemExit(f"{package} is at {old} already: release a higher version")
    changelog_path = package_dir / "CHANGELOG.md"
    changelog = dated_changelog(changelog_path.read_text(), new,
                                today or datetime.date.today())
    pyproject_path.write_text(VERSION_LINE.sub(f'version = "{new}"', pyproject, count=1))
    changelog_path.write_text(changelog)
    if build:
        subprocess.run([sys.executable, "-m", "build", "--outdir", str(ROOT / "dist" / package),
                        str(package_dir)], check=True)
    print(f"{package} {old} -> {new}. Next: git commit -am 'release {package} {new}' && "
          f"git tag {package}-v{new}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("package")
    parser.add_argument("version")
    parser.add_argument("--no-build", action="store_true", help="change the files only")
    arguments = parser.parse_args()
    release(arguments.package, arguments.version, build=not arguments.no_build)


if __name__ == "__main__":
    main()
