"""The one root of this project's errors, and the exit code each kind of failure gives the command line.

Every failure the program knows how to describe is a `FullyAsyncError` whose `str()` is one line saying what went
wrong and what to do; `__main__` prints that line (no traceback unless `run.log_level=DEBUG`) and exits with the
class's `exit_code`: 2 for what the user must fix before starting (configuration, data), 1 for a run that failed.
"""

from __future__ import annotations

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2


class FullyAsyncError(Exception):
    """Root of this project's errors; `str(error)` is one line."""

    exit_code: int = EXIT_FAILED


class ConfigError(FullyAsyncError, ValueError):
    """A configuration problem; `str(error)` is one line that names the key and how to fix it. `key`, where one
    key is refused, is that key (dotted), for callers that report it in their own terms (an rLLM program's runner)."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class DataError(FullyAsyncError, ValueError):
    """Bad training or validation data; `str(error)` names the file, the row and the field."""

    exit_code = EXIT_BAD_INPUT


def first_line(exc: BaseException) -> str:
    """The first non-empty line of an exception's message (its type's name if it has none)."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
