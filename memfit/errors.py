"""The one error type for bad user input (config, flags, data, paths, requests).

Every stage raises it; each front end maps it once: the CLIs print it and exit with code 2, the HTTP server
answers with an OpenAI-shaped 400 error body. Anything else that escapes is a bug, not a user mistake.
"""

from __future__ import annotations

import sys


class UserError(Exception):
    """Bad input from the user (config, data, paths). The CLI prints it and exits with code 2."""


def exit_on_user_error(prog: str, e: UserError) -> int:
    """Print ``prog: error: <message>`` to stderr and return the CLI exit code for bad input (2)."""
    print(f"{prog}: error: {e}", file=sys.stderr)
    return 2
