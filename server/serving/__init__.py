"""Serving inference-only devices: the deployable codebook (``export``) and the
codebook-distribution service (``distribution``) that keeps their copies current
(docs/inference.md). The devices' side is ``starfed.shared.inference``.
"""
