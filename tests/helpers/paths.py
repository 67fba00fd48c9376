"""Where the tests find the repository and the shared real-data folder."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
"""The checkout's root (configs/, docs/, the Makefile)."""

SHARED_DATA = Path(os.environ.get("SHARED_DATA") or REPO.parent / "shared" / "data")
"""The shared real-data folder: ``$SHARED_DATA``, by default ``<checkout>/../shared/data``.
Tests that read it skip where it is absent."""
