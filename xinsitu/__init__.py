"""Train ML models in place on chunked n-dimensional archives, straight from xarray.

``import xinsitu`` registers the ``Dataset.insitu`` accessor.
"""

from xinsitu import accessor as _accessor  # noqa: F401  (registers ds.insitu)
from xinsitu.batches.generator import BatchGenerator
from xinsitu.batches.mapstyle import InsituDataset
from xinsitu.batches.stats import merge_stats
from xinsitu.batches.validity import merge_validity
from xinsitu.cache.chunk_cache import ChunkCache
from xinsitu.index.geometry import Geometry, VarGeometry
from xinsitu.index.manifest import SplitManifest
from xinsitu.index.source import SourceError
from xinsitu.stores.backend import ChunkReadError
from xinsitu.stores.opening import open_zarr

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
