"""Under CI (`CI` set to anything but "", 0, false or no; `.ci/run` sets CI=true) a skipped test
fails, unless it needs a GPU: there a skip can only hide a failure (a wheel that could not be
fetched, a package that did not install, a model that did not import).

Loaded by tests/conftest.py; `pytest -p ci_skips` with tests/ on the path loads it alone.
"""

from __future__ import annotations

import os

import pytest

ALLOWED = "needs a CUDA device"   # the reason tests/conftest.py gives `gpu` tests on a machine without one


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _reason(report) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


def _fail(report, what: str) -> None:
    report.outcome = "failed"
    report.longrepr = (f"{what} was skipped under CI ({_reason(report)}); CI runs every test that needs "
                       f"no GPU: fix the cause, or unset CI to allow skips locally")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if in_ci() and report.skipped and not hasattr(report, "wasxfail") and ALLOWED not in _reason(report):
        _fail(report, item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    report = (yield).get_result()   # a module-level importorskip skips the whole module at collection
    if in_ci() and report.skipped and ALLOWED not in _reason(report) and "/gpu/" not in str(collector.path):
        _fail(report, str(collector.path))
