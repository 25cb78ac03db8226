"""gateway.ops.logs: journal detection, priority prefixes, MCP_* fields, the journal target."""

from __future__ import annotations

import faulthandler
import logging
import os
import re
import subprocess
import sys
import textwrap
import typing
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.ops import logs

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def restore_root_logger() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    for h in root.handlers[:]:
        if h not in handlers:
            root.removeHandler(h)
            h.close()
    root.setLevel(level)


def stream_id(fd: int) -> str:
    st = os.fstat(fd)
    return f"{st.st_dev}:{st.st_ino}"


def record(level: int = logging.INFO, msg: str = "hello %s", args: tuple = ("world",), **extra):
    rec = logging.LogRecord("gateway.hub", level, __file__, 1, msg, args, None)
    rec.__dict__.update(extra)
    return rec


# --- detection ---------------------------------------------------------------------------------


def test_journal_stream_matches_fstat_of_the_fd(tmp_path: Path) -> None:
    with open(tmp_path / "a", "w") as a, open(tmp_path / "b", "w") as b:
        assert logs.journal_stream_matches({"JOURNAL_STREAM": stream_id(a.fileno())}, a.fileno())
        # set, but for another stream (inherited by a child whose stderr was redirected)
        assert not logs.journal_stream_matches(
            {"JOURNAL_STREAM": stream_id(b.fileno())}, a.fileno()
        )


@pytest.mark.parametrize("value", [None, "", "garbage", "1:", ":2", "x:y"])
def test_journal_stream_unset_or_malformed_is_not_the_journal(value: str | None) -> None:
    env = {} if value is None else {"JOURNAL_STREAM": value}
    assert not logs.journal_stream_matches(env, 2)


def test_journal_stream_on_a_closed_fd_is_not_the_journal() -> None:
    r, w = os.pipe()
    ident = stream_id(w)
    os.close(r)
    os.close(w)
    assert not logs.journal_stream_matches({"JOURNAL_STREAM": ident}, w)


# --- formats -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("level", "prio"),
    [
        (logging.DEBUG, 7),
        (logging.INFO, 6),
        (logging.WARNING, 4),
        (logging.ERROR, 3),
        (logging.CRITICAL, 2),
        (5, 7),
    ],
)
def test_syslog_priority(level: int, prio: int) -> None:
    assert logs.syslog_priority(level) == prio


def test_journal_format_prefixes_every_line() -> None:
    fmt = logs.JournalStreamFormatter()
    assert fmt.format(record(logging.WARNING)) == "<4>gateway.hub: hello world"
    assert fmt.format(record(logging.ERROR, "a\nb", ())) == "<3>gateway.hub: a\n<3>b"
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        rec = logging.LogRecord(
            "gateway.hub", logging.ERROR, __file__, 1, "failed", (), sys.exc_info()
        )
    lines = fmt.format(rec).split("\n")
    assert len(lines) > 3
    assert all(line.startswith("<3>") for line in lines)
    assert lines[-1] == "<3>RuntimeError: boom"


def test_plain_format_has_time_level_logger_and_fields() -> None:
    fmt = logs.PlainFormatter()
    line = fmt.format(record(MCP_BACKEND="time", MCP_CONN=7))
    assert re.fullmatch(
        r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO gateway.hub: hello world backend=time conn=7",
        line,
    ), line
    assert fmt.format(record()).endswith("INFO gateway.hub: hello world")
    assert fmt.format(record(MCP_BACKEND=None)).endswith("hello world")


def test_journal_format_shows_fields_too() -> None:
    fmt = logs.JournalStreamFormatter()
    assert fmt.format(record(MCP_BACKEND="demo")) == "<6>gateway.hub: hello world backend=demo"


# --- setup_logging -----------------------------------------------------------------------------


def test_setup_logging_auto_plain_when_stderr_is_not_the_journal(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("JOURNAL_STREAM", "1:1")
    logs.setup_logging("debug")
    logging.getLogger("gateway.test").debug("up %d", 3, extra={"MCP_BACKEND": "time"})
    err = capfd.readouterr().err
    assert re.search(r"^\S+ \S+ DEBUG gateway.test: up 3 backend=time$", err, re.M), err
    assert faulthandler.is_enabled()


def test_setup_logging_auto_prefixes_when_stderr_is_the_journal(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("JOURNAL_STREAM", stream_id(2))
    logs.setup_logging("info")
    log = logging.getLogger("gateway.test")
    log.debug("hidden")
    log.warning("careful", extra={"MCP_CONN": "c1"})
    assert capfd.readouterr().err == "<4>gateway.test: careful conn=c1\n"


def test_setup_logging_stderr_target_is_plain_even_on_the_journal_stream(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("JOURNAL_STREAM", stream_id(2))
    logs.setup_logging("info", "stderr")
    logging.getLogger("gateway.test").warning("careful", extra={"MCP_CONN": "c1"})
    err = capfd.readouterr().err
    assert re.search(r"^\S+ \S+ WARNING gateway.test: careful conn=c1$", err, re.M), err


def test_every_configurable_log_target_is_accepted() -> None:
    from gateway.config import GatewaySection  # issue 7: "stderr" passed the config, then crashed

    configurable = typing.get_args(typing.get_type_hints(GatewaySection)["log_target"])
    assert set(configurable) == set(logs.TARGETS)
    for target in configurable:
        logs.setup_logging("info", target)


def test_setup_logging_twice_replaces_its_handler(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    before = len(logging.getLogger().handlers)
    logs.setup_logging()
    logs.setup_logging("warning")
    assert len(logging.getLogger().handlers) == before + 1
    assert logging.getLogger().level == logging.WARNING


@pytest.mark.parametrize(("level", "target"), [("loud", "auto"), ("info", "syslog")])
def test_setup_logging_rejects_bad_arguments(level: str, target: str) -> None:
    with pytest.raises(ValueError):
        logs.setup_logging(level, target)


def test_journal_target_uses_journal_handler_when_importable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sent: list[dict] = []

    class FakeJournalHandler(logging.Handler):
        def __init__(self, **kwargs: str) -> None:
            super().__init__()
            self.kwargs = kwargs

        def emit(self, rec: logging.LogRecord) -> None:
            sent.append({**self.kwargs, "MESSAGE": rec.getMessage(), **rec.__dict__})

    fake = type(sys)("systemd.journal")
    fake.JournalHandler = FakeJournalHandler
    monkeypatch.setitem(sys.modules, "systemd", type(sys)("systemd"))
    monkeypatch.setitem(sys.modules, "systemd.journal", fake)
    logs.setup_logging("info", "journal")
    logging.getLogger("gateway.test").info("call", extra={"MCP_BACKEND": "time"})
    assert sent[-1]["SYSLOG_IDENTIFIER"] == "mcp-gateway"
    assert sent[-1]["MESSAGE"] == "call"
    assert sent[-1]["MCP_BACKEND"] == "time"


def test_journal_target_falls_back_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "systemd.journal", None)  # import fails
    monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    logs.setup_logging("info", "journal")
    err = capfd.readouterr().err
    assert "WARNING gateway.ops.logs: log target 'journal' needs systemd-python" in err


def test_prefixes_in_a_real_process_whose_stderr_is_the_stream(tmp_path: Path) -> None:
    """End to end: a child whose fd 2 matches $JOURNAL_STREAM (as systemd sets it up)."""
    child = textwrap.dedent(
        """
        import faulthandler, logging, os
        assert not faulthandler.is_enabled()
        st = os.fstat(2)
        os.environ["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino}"
        from gateway.ops.logs import setup_logging
        setup_logging("debug")
        log = logging.getLogger("gateway.child")
        log.debug("d"); log.info("i"); log.warning("w"); log.error("e"); log.critical("c")
        assert faulthandler.is_enabled()
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}
    env["PYTHONPATH"] = str(REPO)
    with open(tmp_path / "stderr", "w+") as err:
        subprocess.run([sys.executable, "-c", child], stderr=err, check=True, env=env)
        err.seek(0)
        lines = err.read().splitlines()
    assert lines == [f"<{p}>gateway.child: {m}" for p, m in zip("76432", "diwec", strict=True)]


def test_repeat_filter_holds_back_a_flood_from_one_call_site_and_counts_it() -> None:
    from gateway.ops.logs import RepeatFilter

    now = [0.0]
    f = RepeatFilter(burst=3, interval=1.0, clock=lambda: now[0])

    def record(msg: str, level: int = logging.WARNING, line: int = 10) -> logging.LogRecord:
        return logging.LogRecord("gateway.x", level, "x.py", line, msg, None, None)

    passed = [f.filter(record("answered unknown id %r")) for _ in range(100)]
    assert passed.count(True) == 3  # the burst, then nothing within the same instant
    assert f.filter(record("another site", line=11))  # other call sites are not held back
    assert f.filter(record("an error", level=logging.ERROR))  # errors always pass
    assert all(f.filter(record("[%s] %s", level=logging.INFO, line=12)) for _ in range(100))
    now[0] = 1.0
    r = record("answered unknown id %r")
    assert f.filter(r) and r.msg.endswith("[97 more like this not logged]")
    assert not f.filter(record("answered unknown id %r"))
