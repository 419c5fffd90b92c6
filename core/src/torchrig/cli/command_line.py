"""What the commands that take a MODEL and the launch's flags (``estimate-memory``, ``plan``) parse
alike: a usage error is one line naming the command's ``--help`` and exits 2 (``cli.main``'s
guard), and counts are positive integers. Torch-free."""

from __future__ import annotations

import argparse
from typing import NoReturn

from torchrig.errors import TorchrigError
from torchrig.estimate.plan_command import positive_int  # one definition; the plan's flags take it too


class UsageError(TorchrigError):
    """Bad command line: one line, exit 2."""


class CommandParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are :class:`UsageError` (no usage block, no ``SystemExit``)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see `{self.prog} --help`)")


__all__ = ["CommandParser", "UsageError", "positive_int"]
