"""What researchers run: single-site training (``train_local``), `starfed simulate` on Flower or
the local runtime (``simulate``, ``local_grid``) with the simulated sites' folders written by the
simulation, and `starfed experiment` (grids of scenarios × methods × seeds; each baseline a
strategy in ``methods``). docs/simulation.md, docs/results.md.
"""
