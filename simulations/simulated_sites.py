"""The simulated sites' data folders, written by the simulation before each step.

A simulated site is a node whose data folder the scenario fills: each task folder appears at
the step the site's stream reaches it (``Scenario.write_site``), as a deployed site's operator
would drop it. The simulation's server process writes every simulated site's folder before each
step (the coordinator's ``before_step``), at the place the site finds it by its partition alone
(``starfed.client.answer.simulated_site_dir``): sites read folders, never the scenario. Both
runtimes do this — the local runtime (``local_grid.run_locally``) and the Flower runtime's
simulation ServerApp (``server_app``) — and the deployment's ServerApp never does.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from starfed.client.answer import simulated_site_dir
from starfed.shared.config import parse, run_dir
from starfed.shared.data.scenario import Scenario, ScenarioConfig


class SimulatedSites:
    """Writes the data folder of each of a scenario's sites in a run folder, step by step."""

    def __init__(self, scenario: Scenario, run_folder: Path) -> None:
        self.scenario = scenario
        self.run_folder = run_folder

    @classmethod
    def of(cls, run_config: Mapping[str, object], run_id: int) -> SimulatedSites:
        """The ``num-sites`` sites of the run config's scenario, in the run's folder."""
        values = parse(dict(run_config))
        scenario = Scenario(ScenarioConfig.from_config(values))
        return cls(scenario, run_dir(values, run_id))

    def __call__(self, step: int) -> None:
        """Every site's data folder as it looks at ``step`` (idempotent)."""
        for partition in range(self.scenario.n_sites):
            data_dir = simulated_site_dir(self.run_folder, partition) / "data"
            self.scenario.write_site(partition, data_dir, step)
