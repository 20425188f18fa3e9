"""The ssmspec command-line interface (Typer): one module per command."""
