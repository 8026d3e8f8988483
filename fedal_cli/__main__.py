"""`python -m fedal_cli`: the `fedal` command."""

from fedal_cli.main import main

main()
