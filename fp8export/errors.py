"""The one user-facing error type, and the exit codes of the CLI contract (DESIGN.md)."""

from __future__ import annotations

EXIT_OK = 0
EXIT_BAD_INPUT = 1  # bad input or environment: one clear message, no traceback
EXIT_USAGE = 2  # click's own usage errors
EXIT_VERIFY_FAILED = 3  # verification ran and the candidate failed its thresholds


class Fp8ExportError(Exception):
    """A problem with the user's input or environment.

    The message names the file, tensor or option at fault and says what to do about it. The
    CLI prints it as ``Error: <message>`` and exits 1 without a traceback. Any other exception
    is a bug in fp8export and keeps its traceback.
    """


class VerificationFailed(Exception):
    """Verification ran to the end and the candidate missed its thresholds (exit code 3).

    ``result`` holds the JSON-serialisable verification result (the report was already written).
    """

    def __init__(self, message: str, result: object | None = None):
        super().__init__(message)
        self.result = result
