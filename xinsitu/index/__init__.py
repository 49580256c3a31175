"""Layer 1, pure: what a split is and which samples an epoch yields, as index math on numpy arrays.

``source`` (a variable's chunk grid and CF encoding, read from metadata), ``geometry`` (chunk geometry of a
Dataset), ``split`` and ``manifest`` (chunk-aligned splits, ``SplitManifest``), ``runs`` (its compact
encodings: runs of ids, of steps, owners, masks), ``sampling`` (windows, tiles, ``over``: a split's sample
space), ``shuffle`` and ``plan`` (who yields which samples, per epoch and rank), ``state`` (the resumable
state), ``channels`` (the channel rule, CF decoding, normalising), ``regions`` (a region's chunks),
``snapshot`` and ``xr_adapter``. No I/O and no threads here.
"""

from xinsitu.index.geometry import Geometry
from xinsitu.index.manifest import SplitManifest

__all__ = ["Geometry", "SplitManifest"]
