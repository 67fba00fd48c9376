"""What every report's figures share."""

from __future__ import annotations


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only, no display), imported on first
    use: a report without figures never loads matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
