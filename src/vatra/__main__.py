"""``python -m vatra`` runs the command line."""

from vatra.cli import main

main()
