"""The meta-package installs the five packages at versions its ranges admit, and ships no code."""

from __future__ import annotations

from importlib.metadata import distribution, version

from packaging.requirements import Requirement

STACK = {"tokenspan", "tpfragments", "saecodec", "vllm-envoys", "vllm-runner"}


def test_it_requires_the_whole_stack_and_the_installed_versions_fit() -> None:
    requirements = [Requirement(text) for text in distribution("vllm-interp").requires]
    plain = {r.name: r for r in requirements if r.marker is None}
    assert set(plain) == STACK
    for name, requirement in plain.items():
        assert requirement.specifier.contains(version(name), prereleases=True), (
            f"{name} {version(name)} is outside vllm-interp's range {requirement.specifier}")


def test_extras_bring_vllm_and_the_demo() -> None:
    requirements = [Requirement(text) for text in distribution("vllm-interp").requires]
    extras = {r.marker.evaluate({"extra": extra}) and extra: r for r in requirements
              if r.marker is not None for extra in ("cpu", "cuda")
              if r.marker.evaluate({"extra": extra})}
    assert extras["cpu"].name == extras["cuda"].name == "vllm-runner"
    assert extras["cpu"].extras == {"cpu", "demo"} and extras["cuda"].extras == {"cuda", "demo"}


def test_it_ships_no_code() -> None:
    files = [str(path) for path in distribution("vllm-interp").files or []]
    assert not [path for path in files if path.endswith(".py")], files
