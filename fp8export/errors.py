"""The one user-facing error type, and the exit codes of the CLI contract (DESIGN.md)."""

from __future__ import annotations

EXIT_OK = 0
EXIT_BAD_INPUT = 1  # bad input or environment: one clear message, no traceback
EXIT_USAGE = 2  # usage errors: click's own and UsageError
EXIT_VERIFY_FAILED = 3  # verification ran and the candidate failed its thresholds
EXIT_INTERNAL = 4  # an unexpected exception: a bug in fp8export, not the user's input
EXIT_INTERRUPTED = 130  # Ctrl-C (SIGINT), the shell convention 128 + 2


class Fp8ExportError(Exception):
    """A problem with the user's input or environment.

    The message names the file, tensor or option at fault and says what to do about it. The
    CLI prints it as ``Error: <message>`` and exits 1 without a traceback. Any other exception
    is a bug in fp8export: exit 4, with how to report it (the traceback with ``--debug`` or
    ``FP8EXPORT_DEBUG=1``).
    """


class UsageError(Fp8ExportError):
    """An option value, or a combination of options, that cannot work (exit code 2).

    Raised by config validation before any file is read, so library users catch it as an
    Fp8ExportError while the CLI reports it as the usage error it is. Problems found in an
    input file are plain Fp8ExportError (exit 1), even when an option led to them.
    """


class VerificationFailed(Exception):
    """Verification ran to the end and the candidate missed its thresholds (exit code 3).

    ``result`` holds the JSON-serialisable verification result (the report was already written).
    """

    def __init__(self, message: str, result: object | None = None):
        super().__init__(message)
        self.result = result


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived: unwinds exactly like Ctrl-C, so every temporary output is
    removed on the way out; the CLI exits 128 + the signal number."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum
