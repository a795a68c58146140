"""s4w_core.config: every S4W_* knob declared once, typed accessors, the doc generated from it."""

from __future__ import annotations

import os
import re

import pytest
import torch

import s4w_core
from s4w_core import cli, config
from s4w_core.errors import ConfigError, S4WError
from s4w_core.format.limits import set_limits

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
#: variables of the test suite and CI, not of the library (docs/DEVELOPING.md)
TEST_ONLY = {"S4W_GPU_EXTRA", "S4W_GPU_RESULTS", "S4W_LONG_TESTS", "S4W_REQUIRE_NUMBA", "S4W_REQUIRE_S3",
             "S4W_TEST_WORKERS", "S4W_WEED"}
#: modules that read their knobs from os.environ themselves: none (keep it so)
PENDING: set[str] = set()


def _sources() -> dict[str, str]:
    out = {}
    for top in ("s4w_core", "integrations"):
        for dp, _d, fs in os.walk(os.path.join(ROOT, top)):
            for f in fs:
                if f.endswith(".py"):
                    p = os.path.join(dp, f)
                    out[os.path.relpath(p, ROOT)] = open(p, encoding="utf-8").read()
    return out


def test_the_doc_holds_the_modules_table() -> None:
    doc = open(os.path.join(ROOT, "docs", "CONFIG.md"), encoding="utf-8").read()
    assert config.markdown_table() in doc
    assert len(re.findall(r"^\| `S4W_", doc, re.M)) == len(config.KNOBS)


def test_every_knob_the_code_names_is_declared_once() -> None:
    named = set()
    for text in _sources().values():
        named |= set(re.findall(r"S4W_[A-Z0-9_]*[A-Z0-9]", text))
    assert named - TEST_ONLY - set(config.KNOBS) == set(), "declare these in s4w_core/config.py"
    assert set(config.KNOBS) - named == set(), "declared but read nowhere"
    assert len(config.KNOBS) == len({k.name for k in config.KNOBS.values()})


def test_only_config_reads_the_environment_for_knobs() -> None:
    readers = {p for p, text in _sources().items()
               if re.search(r"\.get\(\s*f?[\"']S4W_|environ\s*\[\s*f?[\"']S4W_|environ\.get\(\s*(ENV|WARM_UP_ENV|ENV_VAR)\b|getenv\(", text)}
    assert readers - PENDING == set(), "read S4W_* knobs through s4w_core.config"


def test_accessors(monkeypatch: pytest.MonkeyPatch) -> None:
    for v in ("", "  "):
        monkeypatch.setenv("S4W_STAGE_AHEAD", v)
        assert config.get_int("S4W_STAGE_AHEAD") == 4
    monkeypatch.setenv("S4W_STAGE_AHEAD", " 3 ")
    assert config.get_int("S4W_STAGE_AHEAD") == 3
    monkeypatch.setenv("S4W_GPU_BATCH_BYTES", "64M")
    assert config.get_opt_int("S4W_GPU_BATCH_BYTES") == 64 << 20
    monkeypatch.delenv("S4W_GPU_BATCH_BYTES")
    assert config.get_opt_int("S4W_GPU_BATCH_BYTES") is None
    for v, want in (("1", True), ("TRUE", True), ("on", True), ("0", False), ("no", False), ("Off", False)):
        monkeypatch.setenv("S4W_NUMBA", v)
        assert config.get_bool("S4W_NUMBA") is want
    monkeypatch.setenv("S4W_S3_DEADLINE", "2.5")
    assert config.get_float("S4W_S3_DEADLINE") == 2.5
    monkeypatch.setenv("S4W_LOG_FORMAT", "TEXT")
    assert config.get_str("S4W_LOG_FORMAT") == "text"
    monkeypatch.delenv("S4W_LOG_FORMAT")
    assert config.get_str("S4W_LOG_FORMAT") == "json"


@pytest.mark.parametrize("name,value,expected", [
    ("S4W_STAGE_AHEAD", "two", "a whole number"),
    ("S4W_STAGE_AHEAD", "0", ">= 1"),
    ("S4W_STAGE_AHEAD", "1.5", "a whole number"),
    ("S4W_GPU_BATCH_BYTES", "64X", "K, M, G"),
    ("S4W_NUMBA", "maybe", "1/true/yes/on"),
    ("S4W_S3_DEADLINE", "-1", ">= "),
    ("S4W_S3_DEADLINE", "nan", "a finite number"),
    ("S4W_PROBE_MIN_GAIN", "2", "<= 1"),
    ("S4W_METRICS_PORT", "70000", "<= 65535"),
    ("S4W_LOG_FORMAT", "xml", "one of json, text"),
])
def test_a_bad_value_is_a_config_error_naming_it(monkeypatch: pytest.MonkeyPatch, name: str, value: str, expected: str) -> None:
    monkeypatch.setenv(name, value)
    get = {"bool": config.get_bool, "int": config.get_opt_int, "bytes": config.get_opt_int, "float": config.get_opt_float,
           "str": config.get_str, "choice": config.get_str}[config.KNOBS[name].kind]
    with pytest.raises(ConfigError, match=re.escape(f"{name}={value!r}: expected") + ".*" + re.escape(expected)) as ei:
        get(name)
    assert isinstance(ei.value, S4WError) and isinstance(ei.value, ValueError)


def test_an_undeclared_knob_is_a_bug() -> None:
    with pytest.raises(KeyError):
        config.get_bool("S4W_NO_SUCH_THING")


def test_profiles_are_checked_once() -> None:
    for p in config.PROFILES:
        assert config.check_profile(p) == p
    for bad in ("Fast", "", None, 1, "zstd"):
        with pytest.raises(ConfigError, match="profile must be one of"):
            config.check_profile(bad)
    assert tuple(s4w_core.PROFILES) == config.PROFILES


def test_the_cli_names_a_bad_knob_in_one_line(tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    """A knob that does not parse is a ConfigError: ``s4w`` prints one line and exits 1 (not the
    'unexpected error, a bug in s4w?' of an escaped ValueError)."""
    path = tmp_path / "c.s4w"
    s4w_core.save({"w": torch.ones(3)}, path)
    set_limits(None)  # read S4W_LIMITS again
    try:
        monkeypatch.setenv("S4W_LIMITS", "manifest_bytes=lots")
        assert cli.main(["info", str(path)]) == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith("s4w: error: ConfigError: S4W_LIMITS: cannot read 'manifest_bytes=lots'") and "\n" not in err
    finally:
        monkeypatch.delenv("S4W_LIMITS")
        set_limits(None)


def test_an_accessor_reads_a_given_mapping_instead_of_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("S4W_STAGE_AHEAD", "5")
    assert config.get_int("S4W_STAGE_AHEAD", {"S4W_STAGE_AHEAD": " 3 "}) == 3
    assert config.get_int("S4W_STAGE_AHEAD", {}) == 4  # unset there: the default, not the process's 5
    assert config.get_int("S4W_STAGE_AHEAD") == 5
    assert config.get_bool("S4W_ACCELERATE_ASYNC", {"S4W_ACCELERATE_ASYNC": "Yes"}) is True
    assert config.get_str("S4W_ACCELERATE_PROFILE", {"S4W_ACCELERATE_PROFILE": "Fast"}) == "fast"
    with pytest.raises(ConfigError, match="S4W_ACCELERATE_PROFILE='zstd': expected"):
        config.get_str("S4W_ACCELERATE_PROFILE", {"S4W_ACCELERATE_PROFILE": "zstd"})


def _gpu_available() -> object:
    from s4w_core import gpu

    return gpu.available()


def _warm_up() -> object:
    from s4w_core import gpu

    return gpu.warm_up()


def _numba() -> object:
    from s4w_core.planes import _jit

    return _jit.enabled(wait=False)


def _compact() -> object:
    pytest.importorskip("triton")
    from s4w_core.gpu import kernels

    return kernels._compact_config()  # noqa: SLF001


def _probe_gain() -> object:
    pytest.importorskip("triton")
    from s4w_core.gpu import _coder

    return _coder.probe_min_gain()


def _split_block() -> object:
    pytest.importorskip("triton")
    from s4w_core.planes import triton_kernels

    return triton_kernels.block_config(triton_kernels.SPLIT)


@pytest.mark.parametrize("name,good,want,bad,read", [
    ("S4W_DISABLE_GPU", "1", False, "maybe", _gpu_available),
    ("S4W_WARM_UP", "off", False, "2", _warm_up),
    ("S4W_NUMBA", "0", False, "nope", _numba),
    ("S4W_COMPACT_CONFIG", " 4096, 1, 8", (4096, 1, 8), "4096,1", _compact),
    ("S4W_PROBE_MIN_GAIN", "1", 1.0, "1.5", _probe_gain),
    ("S4W_SPLIT_BLOCK", "4096", (4096, 4), "big", _split_block),
], ids=lambda x: x if isinstance(x, str) and x.startswith("S4W_") else "")
def test_the_library_reads_its_knobs_through_config(monkeypatch: pytest.MonkeyPatch, name: str, good: str,
                                                    want: object, bad: str, read: object) -> None:
    """A converted read: a valid value does what it did, each call reads the variable again (tests
    and benchmarks set it at run time), and a bad one is a ConfigError naming it."""
    assert callable(read)
    monkeypatch.setenv(name, good)
    assert read() == want
    monkeypatch.setenv(name, bad)
    with pytest.raises(ConfigError, match=re.escape(f"{name}={bad!r}")):
        read()


def test_accelerate_reads_its_switches_from_an_injected_mapping(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("accelerate")
    import s4w_accelerate

    monkeypatch.setenv("S4W_ACCELERATE", "0")  # the process's variables are not what is read
    monkeypatch.setenv("S4W_WARM_UP", "0")
    store = str(tmp_path / "s")
    try:
        assert s4w_accelerate.enable_from_env({"S4W_ACCELERATE": " off "}) is False
        assert s4w_accelerate.config() is None
        with pytest.raises(ConfigError, match="S4W_ACCELERATE_ASYNC='maybe'"):
            s4w_accelerate.enable_from_env({"S4W_ACCELERATE": "1", "S4W_ACCELERATE_ASYNC": "maybe"})
        assert s4w_accelerate.config() is None
        env = {"S4W_ACCELERATE": store, "S4W_ACCELERATE_PROFILE": "Portable", "S4W_ACCELERATE_ASYNC": "yes"}
        assert s4w_accelerate.enable_from_env(env) is True
        cfg = s4w_accelerate.config()
        assert cfg is not None and (cfg.store, cfg.profile, cfg.async_save) == (store, "portable", True)
        assert cfg.store_options is None  # durable: the default
        assert s4w_accelerate.enable_from_env({"S4W_ACCELERATE": "TRUE", "S4W_ACCELERATE_DURABLE": "0"}) is True
        cfg = s4w_accelerate.config()
        assert cfg is not None and (cfg.store, cfg.profile, cfg.async_save) == (None, "auto", False)
        assert cfg.store_options == {"durable": False}
    finally:
        s4w_accelerate.disable()
