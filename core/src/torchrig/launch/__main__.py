"""``python -m torchrig.launch ...`` is ``torchrig launch ...``."""

import sys

from torchrig.launch.cli import main

sys.exit(main())
