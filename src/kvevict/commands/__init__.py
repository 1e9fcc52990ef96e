"""Subcommands of the ``kvevict`` CLI, discovered by kvevict.cli."""
