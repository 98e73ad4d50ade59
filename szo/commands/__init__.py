"""Command-line subcommands that sit above the library packages they combine.

A command module here may import any part of szo (demos, export, hardware, pipeline); no
library package imports a command. ``szo.cli`` registers each module's subcommands.
"""
