"""GRIB files read in place (public face; the code is in :mod:`xinsitu.formats.grib`).

``open_grib`` opens files as one lazy Dataset, ``grib_store`` gives their virtual store, ``write_grib``
writes a small GRIB2 file (for tests and examples). ``xinsitu.virtual.open_grib`` opens the same way.
"""

from xinsitu.formats.grib import GribError, grib_store, open_grib, write_grib

__all__ = ["GribError", "grib_store", "open_grib", "write_grib"]
