"""The one root of this project's errors, and the exit code each kind of failure gives the command line.

Every failure the program knows how to describe is a `FullyAsyncError` whose `str()` is one line saying what went
wrong and what to do; `__main__` prints that line (no traceback unless `run.log_level=DEBUG`) and exits with the
class's `exit_code`: 2 for what the user must fix before starting (configuration, data), 1 for a run that failed.
"""

from __future__ import annotations

from collections.abc import Sequence

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2


class FullyAsyncError(Exception):
    """Root of this project's errors; `str(error)` is one line."""

    exit_code: int = EXIT_FAILED


class ConfigError(FullyAsyncError, ValueError):
    """A configuration problem; `str(error)` is one line that names the key and how to fix it (several refused keys:
    one line each, `combined`). `key`, where one key is refused, is that key (dotted), for callers that report it
    in their own terms (an rLLM program's runner)."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key
        self.refusals: tuple[ConfigError, ...] = (self,)  # several: `ConfigError.combined`

    @classmethod
    def combined(cls, errors: Sequence[ConfigError]) -> ConfigError:
        """One error for every refusal a config has (each key refused at once, not one edit-and-run per key): its
        first line is the first refusal, saying how many follow; each other refusal is a line of its own (`lines`).
        `key` is the first one's; `refusals` holds them all."""
        if len(errors) == 1:
            return errors[0]
        first, rest = errors[0], errors[1:]
        more = f"{len(rest)} more key{'s' if len(rest) > 1 else ''} refused"
        error = cls("\n".join([f"{first} [and {more}, listed below]", *(str(e) for e in rest)]), key=first.key)
        error.refusals = tuple(errors)
        return error


def error_lines(exc: BaseException) -> list[str]:
    """What the command line prints for an error: its first line, and for a ConfigError of several refusals one
    line for each of the others."""
    refusals = getattr(exc, "refusals", ())
    if len(refusals) > 1:
        return [first_line(exc), *(first_line(e) for e in refusals[1:])]
    return [first_line(exc)]


class DataError(FullyAsyncError, ValueError):
    """Bad training or validation data; `str(error)` names the file, the row and the field."""

    exit_code = EXIT_BAD_INPUT


def first_line(exc: BaseException) -> str:
    """The first non-empty line of an exception's message (its type's name if it has none)."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
