"""The one error type library code raises for problems a user can fix."""


class MinigptError(Exception):
    """A user-facing failure: the CLI prints the message on one line and exits with `exit_code`.

    Messages name the problem and, where there is one, the fix.
    """

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class UsageError(MinigptError):
    """An option value or combination that cannot work (exit code 2, like a CLI usage error)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, exit_code=2)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C ended a command before it could finish cleanly: the CLI prints the message (what was kept and
    what was lost) and exits with 130. A KeyboardInterrupt, so code that lets Ctrl-C through still does."""
