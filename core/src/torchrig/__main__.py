"""``python -m torchrig`` is the ``torchrig`` command."""

import sys

from torchrig.cli.main import main

sys.exit(main())
