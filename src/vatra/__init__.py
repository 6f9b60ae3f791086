"""vatra: distributed PyTorch training that keeps going, sends few bytes and keeps data private."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("vatra")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
