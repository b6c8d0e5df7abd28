"""Inference with a codebook: predictions and scores on images (``predict``), and an
inference device's copy of a federation's codebook kept current by the codebook service
(``follow``; docs/inference.md).
"""
