"""The command line, ``qualia`` / ``python -m qualia``: :mod:`qualia.cli.main` (the parser and
the subcommands), :mod:`qualia.cli.options` (the option types), :mod:`qualia.cli.cluster` (the
``--replicas`` run)."""
