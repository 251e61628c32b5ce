"""The CPU name that keys cached measurements (``tidespec.files.cpu_name``), and measurements taken
once by one process at a time (``measure_once``)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tidespec.files import cpu_name, measure_once

ZEN = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: {family}
model\t\t: {model}
model name\t: AMD EPYC
stepping\t: 1

processor\t: 1
cpu family\t: 99
model name\t: another
"""


def test_cpu_name_tells_hosts_with_one_marketing_name_apart(tmp_path: Path) -> None:
    """Two cloud hosts both called "AMD EPYC" (Zen 4: family 25, Zen 5: family 26) get different names;
    only the first processor's block is read; without the numbers the marketing name stands alone."""
    zen4, zen5 = tmp_path / "zen4", tmp_path / "zen5"
    zen4.write_text(ZEN.format(family=25, model=17), encoding="utf-8")
    zen5.write_text(ZEN.format(family=26, model=2), encoding="utf-8")
    assert cpu_name(zen4) == "AMD EPYC (family 25, model 17)"
    assert cpu_name(zen5) == "AMD EPYC (family 26, model 2)"
    bare = tmp_path / "bare"
    bare.write_text("model name\t: Some CPU\n", encoding="utf-8")
    assert cpu_name(bare) == "Some CPU"
    assert cpu_name(tmp_path / "missing")  # no cpuinfo: the platform's name, never empty


def test_a_measurement_is_taken_once_by_one_of_two_asking_at_once(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Two callers (threads here: each takes the lock through its own open file, as processes do)
    ask for one entry at once: one measures, the other waits and reads what it wrote; later callers
    read it; an unreadable entry is measured again."""
    monkeypatch.setenv("TIDESPEC_CACHE", str(tmp_path / "cache"))
    entry = tmp_path / "entry.txt"
    measured: list[int] = []

    def read() -> str | None:
        return entry.read_text() if entry.exists() and entry.read_text() else None

    def measure() -> str:
        measured.append(1)
        time.sleep(0.3)  # the other caller arrives while this one measures
        entry.write_text("42")
        return "42"

    got: list[str] = []
    callers = [threading.Thread(target=lambda: got.append(measure_once(entry, read, measure))) for _ in range(2)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    assert got == ["42", "42"] and len(measured) == 1
    assert measure_once(entry, read, measure) == "42" and len(measured) == 1
    entry.write_text("")  # torn or stale: read() says None
    assert measure_once(entry, read, measure) == "42" and len(measured) == 2
