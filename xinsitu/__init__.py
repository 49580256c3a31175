"""Train ML models in place on chunked n-dimensional archives, straight from xarray.

``import xinsitu`` registers the ``Dataset.insitu`` accessor.
"""

from xinsitu import accessor as _accessor  # noqa: F401  (registers ds.insitu)
from xinsitu.cache import ChunkCache
from xinsitu.dataset import InsituDataset
from xinsitu.geometry import Geometry, VarGeometry
from xinsitu.loader import BatchGenerator
from xinsitu.manifest import SplitManifest
from xinsitu.reader import ChunkReadError
from xinsitu.source import SourceError
from xinsitu.stats import merge_stats
from xinsitu.store import open_zarr
from xinsitu.validity import merge_validity

__version__ = "0.1.0"
__all__ = ["BatchGenerator", "ChunkCache", "ChunkReadError", "Geometry", "InsituDataset", "SourceError",
           "SplitManifest", "VarGeometry", "merge_stats", "merge_validity", "open_zarr", "__version__"]


def __getattr__(name: str) -> object:
    # ``xinsitu.virtual.open_netcdf(...)`` after a plain ``import xinsitu``, without importing
    # VirtualiZarr (and the NetCDF/GRIB stack) at ``import xinsitu``
    if name == "virtual":
        import importlib

        return importlib.import_module("xinsitu.virtual")
    raise AttributeError(f"module 'xinsitu' has no attribute {name!r}")
