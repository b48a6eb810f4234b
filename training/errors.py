"""The one error type that the CLIs turn into a clear message and exit code 2."""


class UserError(Exception):
    """Bad input from the user (config, data, paths). The CLI prints it and exits with code 2."""
