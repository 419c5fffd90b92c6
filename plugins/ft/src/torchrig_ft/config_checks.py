"""The ft plugin's configuration checks (``torchrig_validate_config``): what torchft would only fail
on once a worker tries to reach its lighthouse. Torch-free; imported by the manifest's hook, so a
run that does not select ``ft`` never imports the options class (benchmark B12)."""

from __future__ import annotations

from torchrig.plugin import ConfigProblem, ResolvedConfig

from torchrig_ft.constants import LIGHTHOUSE_ENV, SECTION
from torchrig_ft.options import FTKwargs


def ft_problems(config: ResolvedConfig) -> list[ConfigProblem]:
    """A replica group cannot find its peers without the lighthouse: refused before any process starts."""
    if config.section_of(FTKwargs).lighthouse.strip():
        return []
    return [ConfigProblem(f"{SECTION}.lighthouse", (
        "strategy 'ft' needs the address of a torchft lighthouse (e.g. http://host:29510); set it in the "
        f"config file's {SECTION}: section, with --ft_lighthouse, or {LIGHTHOUSE_ENV}, after starting one "
        "with `torchft_lighthouse --min_replicas 1 --bind [::]:29510`"))]


__all__ = ["ft_problems"]
