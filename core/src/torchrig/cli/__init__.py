"""The ``torchrig`` command line. Importing it must not import torch: ``torchrig --help``,
``--version`` and ``plugins`` answer without it."""
