"""hyper_parallel.dtensor (placeholder, being written)."""
from hyper_parallel.dtensor._version import __version__

__all__ = ["__version__"]
