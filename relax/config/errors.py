"""The one error type of the configuration layer."""


class ConfigError(Exception):
    """A bad flag, value, file key or combination. The message names the flag and the fix.

    The entry point prints it as one line and exits with status 2 (argparse's convention).
    """
