"""pagedjax.models, pagedjax.scheduler and pagedjax.pallas_kernels from a source checkout.

The design card keeps models/, scheduler/ and pallas_kernels/ at the repository's top level; an
install maps them under the pagedjax name (setup.py's package_dir), so a user's environment holds
no top-level `models` or `scheduler`. An installed wheel has them inside pagedjax/, and an
editable install's finder maps them to the checkout. A checkout run without installing (the GPU
device script, `python benchmarks/x.py`) has neither: this finder answers those three names, and
only those, from the folders beside the pagedjax/ that was imported (ahead of an editable
install's finder, which names one checkout only).
"""

from __future__ import annotations

import importlib.machinery
import os
import sys

MAPPED = ("models", "scheduler", "pallas_kernels")
_PACKAGE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_PACKAGE)


class SourceTreeFinder:
    """A meta path finder for pagedjax.<folder>, folder one of MAPPED, at the checkout's root."""

    names = {f"pagedjax.{folder}" for folder in MAPPED}

    @classmethod
    def find_spec(cls, fullname: str, path=None, target=None):
        if fullname not in cls.names:
            return None
        return importlib.machinery.PathFinder.find_spec(fullname, [_ROOT])


def install() -> None:
    """Adds the finder when pagedjax/ is a checkout's (the folders beside it, not inside it)."""
    inside = all(os.path.isdir(os.path.join(_PACKAGE, folder)) for folder in MAPPED)
    beside = all(os.path.isfile(os.path.join(_ROOT, folder, "__init__.py")) for folder in MAPPED)
    if not inside and beside and SourceTreeFinder not in sys.meta_path:
        sys.meta_path.insert(0, SourceTreeFinder)  # the checkout this pagedjax came from
