"""The one exception type for bad input: the CLI prints its message once and exits with code 2."""

USAGE_EXIT_CODE = 2


class UsageError(Exception):
    """Bad input from the user (flags, config file, data, checkpoint). Message only, no traceback."""


class TrainingFailed(Exception):
    """Training cannot go on, and every rank knows it at once (a NaN loss, a failed final save):
    rank 0 prints the message, every rank exits with code 1, no traceback."""
