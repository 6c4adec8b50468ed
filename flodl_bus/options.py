"""What every command line shares: the accepted log levels, checked by argparse itself so
a bad one is refused before anything starts (not as a KeyError in a rank's log)."""

from __future__ import annotations

import argparse
import sys
from typing import Final, NoReturn

LOG_LEVELS: Final = ("debug", "info", "warning", "error", "critical")


class ConfigError(Exception):
    """A configuration mistake of a command's flags; the message names the fix."""


def log_level(text: str) -> str:
    """argparse ``type=`` for ``--log-level``: case-insensitive, one of LOG_LEVELS."""
    return text.lower()


class OneLineParser(argparse.ArgumentParser):
    """argparse whose refusals are one line naming the fix (exit 2), not a usage block."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)
