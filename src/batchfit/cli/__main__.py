"""``python -m batchfit.cli``: the command line, for a process started from Python."""

from batchfit.cli.app import main

main()
