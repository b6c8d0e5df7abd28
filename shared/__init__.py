"""The model: STAR-Prompt (``model``), the codebook that carries it (``codebook``), the data
(``data``), the protocol's phases (``protocol``), every configuration knob (``config``), metrics
and inference with a codebook (``inference``). It imports nothing from Flower and starts no
process, so every layer above can use it (docs/design.md#the-layout).
"""
