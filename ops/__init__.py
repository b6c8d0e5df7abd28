"""Operations the server and the sites share: processes started and stopped by PID and their
records, site key files, the clock against the server's, exit codes, runs submitted and
followed through Flower's ``flwr``, an inference device's codebook kept current (``follow``),
and the one module that imports Flower's non-public modules. Both ``server/ops/`` and
``client/ops/`` (and the simulations and ``starfed predict``) use them; neither side's own
operations are here (docs/design.md#the-layout)."""
