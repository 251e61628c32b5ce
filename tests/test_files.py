"""The CPU name that keys cached measurements (``tidespec.files.cpu_name``)."""

from __future__ import annotations

from pathlib import Path

from tidespec.files import cpu_name

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
