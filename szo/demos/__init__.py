"""Demos: ``szo demo dvs-stream`` (on-line event-stream classification with SZO adaptation)."""
