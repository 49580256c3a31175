"""``python -m xinsitu``: ``inspect URL`` and ``bench URL`` (see ``xinsitu.cli``)."""

import sys

from xinsitu.cli import main

if __name__ == "__main__":
    sys.exit(main())
