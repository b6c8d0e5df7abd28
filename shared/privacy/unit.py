"""What a site's ε protects: a value of its own, so that what names it (a site's setting, the
operator's registry of sites) need not load the mechanisms and their accountant."""

from __future__ import annotations

import enum


class PrivacyUnit(enum.StrEnum):
    """What a site's ε protects: one training image, or one patient (all their images). A
    string enum: a record holding it (the operator's registry of sites) is JSON as it is."""

    IMAGE = "image"
    PATIENT = "patient"
