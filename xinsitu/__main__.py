"""``python -m xinsitu`` (and the ``xinsitu`` script): ``inspect URL`` and ``bench URL``."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``xinsitu`` command; see ``xinsitu.cli``.

    Parameters
    ----------
    argv : list of str, optional
        Arguments (default: ``sys.argv[1:]``).

    Returns
    -------
    int
        Exit status.
    """
    from xinsitu.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
