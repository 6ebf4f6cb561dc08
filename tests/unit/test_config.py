"""Every GRADRING_* variable is parsed in gradring/config.py: defaults, good values,
and bad ones refused with a message naming the variable, the value and the range."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gradring import config
from gradring.comm import desync, select
from gradring.fast_paths import FastPaths


def test_defaults_when_nothing_is_set() -> None:
    c = config.parse({})
    assert c == config.Config()
    assert (c.transport, c.algo, c.timeout, c.check) == (None, None, None, False)
    assert (c.flight_recorder, c.flight_size, c.shm_yield_us) == (None, 256, 50.0)
    assert c.fast_paths == FastPaths() and c.quiet is False


def test_every_field_has_a_variable() -> None:
    assert len(config.VARIABLES) == 11 and len(set(config.VARIABLES)) == 11
    assert all(v.startswith("GRADRING_") for v in config.VARIABLES)


def test_good_values(tmp_path) -> None:
    c = config.parse({
        "GRADRING_TRANSPORT": " SHM ", "GRADRING_ALGO": "Hierarchical",
        "GRADRING_TIMEOUT": "2.5", "GRADRING_CHECK": "on",
        "GRADRING_FLIGHT_RECORDER": str(tmp_path / "fr"), "GRADRING_FLIGHT_SIZE": "16",
        "GRADRING_SHM_YIELD_US": "0",
        "GRADRING_FAST_PATHS": " -Packed", "GRADRING_QUIET": "yes"})
    assert (c.transport, c.algo, c.timeout, c.check) == ("shm", "hierarchical", 2.5, True)
    assert c.flight_recorder == str(tmp_path / "fr") and c.flight_size == 16
    assert c.shm_yield_us == 0.0
    assert c.fast_paths == FastPaths(packed=False) and c.quiet is True
    # Empty means unset.
    assert config.parse({v: "" for v in config.VARIABLES}) == config.Config()


def _bad_file(tmp_path) -> str:
    p = tmp_path / "a-file"
    p.write_text("")
    return str(p)


BAD = [
    ("GRADRING_TRANSPORT", "nccl", "shm, torch"),
    ("GRADRING_ALGO", "bogus", "ring, tree, hierarchical, native"),
    ("GRADRING_TIMEOUT", "abc", "(0, "),
    ("GRADRING_TIMEOUT", "0", "(0, "),
    ("GRADRING_TIMEOUT", "-5", "(0, "),
    ("GRADRING_TIMEOUT", "inf", "(0, "),
    ("GRADRING_TIMEOUT", "nan", "(0, "),
    ("GRADRING_TIMEOUT", "1e30", "(0, "),
    ("GRADRING_CHECK", "maybe", "1, true, yes, on, 0, false, no, off"),
    ("GRADRING_FLIGHT_RECORDER", None, "not a directory"),
    ("GRADRING_FLIGHT_SIZE", "many", "[1, 1000000]"),
    ("GRADRING_FLIGHT_SIZE", "0", "[1, 1000000]"),
    ("GRADRING_FLIGHT_SIZE", "2.5", "[1, 1000000]"),
    ("GRADRING_SHM_YIELD_US", "-1", "[0, 1e+06]"),
    ("GRADRING_SHM_YIELD_US", "fast", "[0, 1e+06]"),
    ("GRADRING_SHM_YIELD_US", "nan", "[0, 1e+06]"),
    ("GRADRING_FAST_PATHS", "fast", "the names are packed, homed"),
    ("GRADRING_FAST_PATHS", "homed,-packed", "not both"),
    ("GRADRING_QUIET", "shh", "1, true, yes, on, 0, false, no, off"),
]


@pytest.mark.parametrize("var,value,valid", BAD, ids=[f"{v}={x}" for v, x, _ in BAD])
def test_bad_values_name_the_variable_the_value_and_the_range(tmp_path, var, value,
                                                              valid) -> None:
    value = _bad_file(tmp_path) if value is None else value
    with pytest.raises(config.ConfigError) as info:
        config.parse({var: value})
    msg = str(info.value)
    assert msg.startswith(f"{var}={value!r} is not valid"), msg
    assert valid in msg, msg
    assert isinstance(info.value, ValueError)


def test_current_follows_the_environment_and_reload_rereads(monkeypatch) -> None:
    monkeypatch.setenv("GRADRING_TIMEOUT", "7")
    assert config.current().timeout == 7.0
    monkeypatch.setenv("GRADRING_TIMEOUT", "8")
    assert config.current().timeout == 8.0
    assert config.reload().timeout == 8.0
    monkeypatch.setenv("GRADRING_TIMEOUT", "-5")
    with pytest.raises(config.ConfigError, match="GRADRING_TIMEOUT='-5'"):
        config.current()
    monkeypatch.delenv("GRADRING_TIMEOUT")
    assert config.current().timeout is None


def test_per_collective_reads_see_each_change(monkeypatch) -> None:
    monkeypatch.setenv("GRADRING_CHECK", "1")
    assert desync.enabled() is True
    monkeypatch.setenv("GRADRING_CHECK", "0")
    assert desync.enabled() is False
    monkeypatch.setenv("GRADRING_CHECK", "banana")
    with pytest.raises(config.ConfigError, match="GRADRING_CHECK='banana'"):
        desync.enabled()
    monkeypatch.delenv("GRADRING_CHECK")
    monkeypatch.setenv("GRADRING_TRANSPORT", "torch")
    assert select.overrides() == ("torch", None)
    monkeypatch.setenv("GRADRING_ALGO", "native")
    assert select.overrides() == ("torch", "native")


def test_a_bad_value_stops_the_import_with_a_clear_error() -> None:
    """The values read at import (flight recorder size) validate the whole config there."""
    out = subprocess.run([sys.executable, "-c", "import gradring"], capture_output=True,
                         text=True, env={"GRADRING_TIMEOUT": "abc", "PATH": "/usr/bin:/bin",
                                         "PYTHONPATH": ":".join(sys.path)}, timeout=120)
    assert out.returncode != 0
    assert "ConfigError: GRADRING_TIMEOUT='abc' is not valid" in out.stderr, out.stderr[-2000:]
