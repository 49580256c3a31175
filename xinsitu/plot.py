"""The drawing of a split manifest (public face; the code is in :mod:`xinsitu.repr.plot`).
``SplitManifest.plot()`` draws one."""

from xinsitu.repr.plot import plot_manifest

__all__ = ["plot_manifest"]
