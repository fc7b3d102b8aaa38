"""``./dev``: its ``iop`` command, which tests ``./dev test`` sets real servers up for, and what
``--fast`` leaves out. The shell function is run as the script defines it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEV = ROOT / "dev"


def selects(target: str, *args: str) -> bool:
    function = re.search(r"^selects\(\) \{\n.*?^\}\n", DEV.read_text(), re.M | re.S)
    assert function is not None, "./dev defines no selects()"
    script = function.group(0) + 'selects "$@"'
    return subprocess.run(["bash", "-c", script, "selects", target, *args], cwd=ROOT).returncode == 0


@pytest.mark.parametrize(("args", "expected"), [
    ((), True),  # the whole suite, as .ci/run asks
    (("-k", "fifo", "-q"), True),  # no path: still the whole suite
    (("tests",), True),
    (("tests/",), True),
    (("tests/realservers",), True),
    (("tests/realservers/test_llamacpp.py::test_x",), True),
    (("tests/dispatcher/config",), False),  # a config test builds no llama.cpp server
    (("tests/iop/test_cli.py", "-k", "reload"), False),
    (("tests/dispatcher", "tests/realservers/test_litellm.py"), True),
])
def test_real_servers_are_set_up_only_for_tests_that_need_them(args: tuple[str, ...], expected: bool) -> None:
    assert selects("tests/realservers", *args) is expected


def test_the_fast_tier_leaves_out_paths_that_exist() -> None:
    listed = re.search(r"^FAST_IGNORE=\((.*?)\)", DEV.read_text(), re.M | re.S)
    assert listed is not None
    paths = listed.group(1).split()
    assert "tests/e2e" in paths
    assert "tests/realservers" in paths
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert missing == [], f"./dev's FAST_IGNORE names paths that are gone: {missing}"


def test_lint_covers_the_packages_mypy_checks() -> None:
    linted = re.search(r"^LINTED=\((.*?)\)", DEV.read_text(), re.M)
    assert linted is not None
    mypy = re.search(r'^packages = \[(.*?)\]', (ROOT / "pyproject.toml").read_text().split("[tool.mypy]")[1], re.M)
    assert mypy is not None
    assert {p.strip(' "') for p in mypy.group(1).split(",")} <= set(linted.group(1).split())


def test_dev_iop_runs_the_command_from_the_virtualenv() -> None:
    done = subprocess.run([str(DEV), "iop", "config", "check", "iop/demo.yaml"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("iop/demo.yaml: OK - 2 model(s)"), done.stdout
