"""``python -m torchrig.launch ...`` is ``torchrig launch ...``."""

from torchrig.launch import held_signals

held_signals.hold()  # first: a SIGUSR1 while the launcher starts is held for the ranks (held_signals)

import sys  # noqa: E402

from torchrig.launch.cli import main  # noqa: E402

sys.exit(main())
