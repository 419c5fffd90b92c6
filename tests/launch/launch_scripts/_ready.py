"""Shared by the scripts: announce this worker (its pid) in the output directory."""

import os
import pathlib
import sys


def announce() -> pathlib.Path:
    out = pathlib.Path(sys.argv[1])
    (out / f"ready-{os.environ.get('RANK', '0')}").write_text(str(os.getpid()))
    return out
