"""Shared test fixtures and model builders.

Why this exists: most tests need a model, and the right one is almost always a tiny random one
(seconds, deterministic, float64 so near-ties cannot hide bugs). Integration tests share one
embedded SmolLM2-135M load per session.

The builders themselves (tiny models, the tokenizer, HF checkpoints) are in ``tests/helpers.py``.

It also keeps ``make test`` honest about its budget (a run of its selection past ``SUITE_BUDGET_S``
ends with a loud section in the log; the run still passes), sets OpenMP's passive wait for the two
xdist workers, and adds ``--break-row-invariance`` for the exactness subset's teeth
(``tests/speculative/test_exact_matrix.py``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

# OpenMP threads that wait for work sleep instead of spinning, set before torch loads OpenMP (the
# xdist workers inherit it): two workers on two cores, each test on one or two intra-op threads, left
# spinning threads contending for the cores and a two-thread decode step took 4x its time alone
# (108-115 ms against 29; passive: 50-52, like one thread each). Scheduling only: no result changes.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch

from tidespec.models.loading.loader import LoadedModel, load_model

_STARTED = pytest.StashKey[float]()


# make test's budget for pytest itself (CI stops the whole job, set-up included, at 30 minutes; the
# promise is 12 with set-up): a run past it passes, but says so at its end where the log is read
SUITE_BUDGET_S = 600.0


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_STARTED] = time.monotonic()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config) -> None:
    """The suite's wall time against ``SUITE_BUDGET_S`` when it is ``make test``'s selection (slow
    tests left out): one line, and a loud section when over budget."""
    if ("not slow" not in (config.getoption("markexpr") or "") or hasattr(config, "workerinput")
            or config.getoption("collectonly")):
        return
    spent = time.monotonic() - config.stash[_STARTED]
    line = f"make test's suite ran {spent / 60:.1f} min of its {SUITE_BUDGET_S / 60:.0f}-minute budget"
    if spent <= SUITE_BUDGET_S:
        terminalreporter.write_line(line)
        return
    terminalreporter.write_sep("!", "TEST SUITE OVER BUDGET", red=True, bold=True)
    terminalreporter.write_line(f"{line}: {spent - SUITE_BUDGET_S:.0f} s over. CI stops make test at 30 minutes "
                                "set-up included; move what grew to make test-slow or make it cheaper (the "
                                "slowest tests are listed above).", red=True, bold=True)
    terminalreporter.write_sep("!", red=True, bold=True)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests of one ``xdist_group`` run one after another, where the first of them was collected
    (``--dist loadgroup`` sends them to one worker in this order): a module-scoped fixture
    parametrized per group, like the exactness subset's ``PathRun`` per path, is then built once, not
    again each time another group's test ran in between. Other tests keep their places."""
    first: dict[str, int] = {}
    places = []
    for i, item in enumerate(items):
        mark = item.get_closest_marker("xdist_group")
        group = str(mark.args[0] if mark.args else mark.kwargs.get("name")) if mark else None
        places.append(first.setdefault(group, i) if group is not None else i)
    order = sorted(range(len(items)), key=places.__getitem__)  # stable: a group keeps its own order
    items[:] = [items[i] for i in order]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--break-row-invariance", default=None, choices=("library-gemm", "attention", "projections"),
                     help="build the exactness subset's engines with one half of row invariance removed, to show that "
                          "it then fails (tests/speculative/test_exact_matrix.py)")


@pytest.fixture(scope="session")
def embedded() -> LoadedModel:
    """The embedded SmolLM2-135M-Instruct in float32 on CPU (converted once into the user cache)."""
    return load_model(None, dtype=torch.float32)


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread() -> Iterator[None]:
    """Run all tests' torch ops on one thread. The suite's models are tiny (or 135M at batch 1):
    intra-op threads only add spin-wait overhead, and on a small CPU shared with other processes
    two OpenMP threads waiting on each other make a forward several times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def two_threads() -> Iterator[None]:
    """Two intra-op threads for one test, as served (``--threads 2``): the row-blocked GEMM paths
    of ``models.llama.Linear`` only run with two or more threads; the rest of the suite runs on one."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)
