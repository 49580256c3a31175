"""Layer 4: files read in place through virtual chunk references.

``references`` (file arguments, the store registry and the checks shared by the formats), ``grib``
(GRIB 1/2, one message per chunk, and its zarr codec), ``netcdf3`` (classic and 64-bit offset NetCDF,
and the CF codecs). ``xinsitu.virtual`` is their public face (``open_netcdf``, ``open_grib``).
"""
