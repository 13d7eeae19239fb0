"""The ``tiering`` command's subcommands, one module each (see :mod:`tiering.cli`)."""
