"""``python -m xinsitu``: ``inspect URL`` and ``bench URL`` (see ``xinsitu.cli``)."""

from xinsitu.cli import entry

if __name__ == "__main__":
    entry()
