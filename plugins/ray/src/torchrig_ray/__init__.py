"""torchrig-ray: the Ray Train cluster plugin. See README.md beside pyproject.toml.

Importing this package imports neither Ray nor torch: the plugin's runtime
(:mod:`torchrig_ray.cluster`) touches Ray only inside a Ray worker, and the checkpoint helpers
(:mod:`torchrig_ray.report`) only when called.
"""

__version__ = "0.1.0"
