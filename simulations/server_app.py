"""The simulation's ServerApp: the deployment's server run, with the simulated sites' folders.

`starfed simulate` (the Flower runtime) and `flwr run .` (pyproject.toml's
``[tool.flwr.app.components]``) run this app: ``run_server`` as the deployment's ServerApp
(``starfed.server.app``) runs it, plus the scenario's sites' data folders written before each
step (``SimulatedSites``). The deployment's ServerApp knows no scenario: its sites bring their
own folders.
"""

from __future__ import annotations

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from starfed.server.app import run_server
from starfed.shared import progress
from starfed.simulations.simulated_sites import SimulatedSites

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    run_config = dict(context.run_config)
    sites = SimulatedSites.of(run_config, context.run_id)
    with progress.logged_to(progress.console(stderr=True)):
        run_server(grid, run_config, context.run_id, before_step=sites)
