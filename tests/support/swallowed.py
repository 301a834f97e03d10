"""Exceptions the product caught and logged instead of raising.

The drafter and the proposer must never take a vLLM step down, so they catch
``Exception`` and log it (``logger.exception``, or a warning that names the
exception) and count it. In a test that also catches a fake's own ``assert``: a
fake that saw a wrong call would go unnoticed, as a counted error. The
``swallowed`` fixture (``tests/conftest.py``, autouse) hangs a
:class:`SwallowedExceptions` handler on duo_vllm's loggers for each test and
fails the test where one of them reported a caught exception, unless the test
says it expects it: ``@pytest.mark.expect_swallowed(RuntimeError, reason="...")``
(those types only, so a fake's ``AssertionError`` still fails a test that injects
a ``RuntimeError``; no types: any exception).

Only records at WARNING and above are seen: debug lines that carry an
exception (probes of the environment, e.g. Ray's daemons not found) are not
failures.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import traceback

# where duo_vllm logs: its own loggers (the drafter, the actor, lending), and those
# under vLLM's (the proposer, the patches; duo_vllm/logs.py)
LOGGERS = ("duo_vllm", "vllm.duo_vllm")


def carried_exception(record: logging.LogRecord) -> BaseException | None:
    """The exception a log record reports: its ``exc_info`` (``logger.exception``), or
    an exception among its arguments (``logger.warning("failed (%s)", e)``)."""
    if record.exc_info and record.exc_info[1] is not None:
        return record.exc_info[1]
    args = record.args if isinstance(record.args, tuple) else (record.args,)
    return next((a for a in args if isinstance(a, BaseException)), None)


class SwallowedExceptions(logging.Handler):
    """Collects the records of duo_vllm's loggers that report a caught exception
    (from any thread: the drafter's background thread logs too)."""

    def __init__(self, loggers=LOGGERS):
        super().__init__(level=logging.WARNING)
        self._loggers = [logging.getLogger(name) for name in loggers]
        self._seen: list[tuple[logging.LogRecord, BaseException]] = []
        self._seen_lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        exc = carried_exception(record)
        if exc is not None:
            with self._seen_lock:
                self._seen.append((record, exc))

    @property
    def exceptions(self) -> list[BaseException]:
        with self._seen_lock:
            return [exc for _, exc in self._seen]

    @contextlib.contextmanager
    def attached(self):
        for logger in self._loggers:
            logger.addHandler(self)
        try:
            yield self
        finally:
            for logger in self._loggers:
                logger.removeHandler(self)

    def unexpected(self, allowed: tuple[type[BaseException], ...] = ()):
        """The records whose exception is none of ``allowed``."""
        with self._seen_lock:
            return [(r, e) for r, e in self._seen if not isinstance(e, allowed)]

    @staticmethod
    def report(found) -> str:
        lines = [f"the product swallowed {len(found)} exception(s) the test did not expect "
                 "(a fake's assert, say); a test that injects them says so: "
                 "@pytest.mark.expect_swallowed(ExceptionType, reason=...)"]
        for record, exc in found:
            lines.append(f"--- {record.name} [{record.levelname}] {record.getMessage()}")
            lines.extend(line.rstrip("\n") for line in
                         traceback.format_exception(type(exc), exc, exc.__traceback__))
        return "\n".join(lines)
