"""`python -m ssmspec` runs the CLI."""
from ssmspec.cli.app import main

main()
