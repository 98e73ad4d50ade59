"""Command-line subcommands that sit above the library packages they combine.

A command module here may import any part of szo (demos, export, hardware, pipeline); no
library package imports a command. ``szo.cli`` declares each command (its name, help, and the
function here that adds its arguments or runs it) and imports the module only when the command
is used.
"""
