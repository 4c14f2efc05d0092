"""`python -m flexsgl ...`: the command line, for environments whose `flexsgl` script runs another Python."""

from flexsgl.cli import app

app()
