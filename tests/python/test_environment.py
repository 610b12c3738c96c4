"""The Python toolchain is the project's locked virtual environment, isolated from the system."""

import site
import sys
from pathlib import Path


def test_runs_inside_a_virtual_environment():
    assert sys.prefix != sys.base_prefix, f"not a venv: sys.prefix={sys.prefix}"


def test_system_site_packages_do_not_leak_in():
    system_dirs = [Path(p) for p in site.getsitepackages([sys.base_prefix])]
    leaked = [p for p in sys.path if any(Path(p) == d for d in system_dirs)]
    assert leaked == [], f"system site-packages on sys.path: {leaked}"
    assert not site.ENABLE_USER_SITE or site.USER_SITE not in sys.path


def test_pytest_comes_from_the_venv():
    import pytest

    assert Path(pytest.__file__).resolve().is_relative_to(Path(sys.prefix).resolve())
