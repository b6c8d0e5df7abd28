"""What a site's ε protects: a value of its own, so that what names it (a site's setting, the
operator's registry of sites) need not load the mechanisms and their accountant."""

from __future__ import annotations

import enum


class PrivacyUnit(enum.Enum):
    """What a site's ε protects: one training image, or one patient (all their images)."""

    IMAGE = "image"
    PATIENT = "patient"
