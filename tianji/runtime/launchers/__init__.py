"""Launchers decide where each role runs and how it starts and restarts: `inline` (one process),
`local` (a process per role on this machine), `ray` (processes on a Ray cluster). `train` looks
them up in `registry.LAUNCHERS`. This package's own import is light on purpose: `ray_boot` must load
without torch, so Ray can start while the command still imports the rest.
"""
