"""The lowest layer: user-facing errors, atomic file output and the staged artifact cache.

Layering runs one way: scripts -> demo -> models / plugins -> core.
"""
