"""``python -m tiering``: the ``tiering`` command (see :mod:`tiering.cli`)."""

from tiering.cli import entry_point

if __name__ == "__main__":
    entry_point()
