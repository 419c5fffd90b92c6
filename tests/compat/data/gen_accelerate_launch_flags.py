"""List the flags of Accelerate's ``accelerate launch``, for ``tests/compat/test_accelerate_launch_flags.py``.

    python -m venv --system-site-packages /tmp/accvenv
    /tmp/accvenv/bin/pip install --no-deps accelerate-1.15.0-py3-none-any.whl
    /tmp/accvenv/bin/python tests/compat/data/gen_accelerate_launch_flags.py

Run it with a Python that imports the Accelerate release to list. It writes
``tests/compat/data/accelerate_launch_flags.json``; the test compares it with what ``torchrig launch``
accepts, so the test runs without Accelerate installed.

The rule (RULE below, recorded in the output): every option string of every action of
``accelerate.commands.launch.launch_command_parser()``, except ``-h``/``--help``; for each action,
its spellings (underscore, dash and short forms), whether it takes a value, and argparse's ``dest``.
"""

from __future__ import annotations

import json
import pathlib

import accelerate
from accelerate.commands.launch import launch_command_parser

RULE = ("every option string of every action of accelerate.commands.launch.launch_command_parser(), "
        "except -h/--help; spellings grouped per action, with whether it takes a value and its dest")


def main() -> None:
    flags = []
    for action in launch_command_parser()._actions:
        if not action.option_strings or "--help" in action.option_strings:
            continue
        flags.append({"spellings": list(action.option_strings), "dest": action.dest,
                      "takes_value": action.nargs != 0})
    out = {"source": f"accelerate {accelerate.__version__} (the released wheel)", "rule": RULE, "flags": flags}
    path = pathlib.Path(__file__).parent / "accelerate_launch_flags.json"
    path.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
