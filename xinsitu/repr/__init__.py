"""Layer 1: what the objects look like in a terminal and a notebook.

``formatting`` builds both reprs from one list of sections (text, and HTML with the packaged CSS and the
text as its fallback) and draws split timelines and grids; each object builds its own sections
(``obj._repr_parts``), so nothing here names a type of the layers above. ``plot`` draws a manifest
with matplotlib.
"""
