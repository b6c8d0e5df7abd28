"""The exit codes of every starfed command, one name each
(docs/federation.md#statuses-and-exit-codes).

Every command exits 0 when done, 1 when something failed and 2 for bad input (one line, before
anything heavy runs). Commands that run a federation (`simulate`, `server run`, `server
resume`) end with the run's status — completed 0, failed 1, degraded 3 — and 130 when Ctrl-C or
SIGTERM stopped the run (as a shell reports Ctrl-C). They live with the operations code because
`simulations/` and `cli/` both return them.
"""

from starfed.shared.run_status import COMPLETED, DEGRADED, FAILED

EXIT_OK = 0  # done; a federation run: completed
EXIT_FAILED = 1  # something failed: a process would not start, a peer refused, the run failed
EXIT_BAD_INPUT = 2  # arguments, files, names: one line, before anything heavy runs
EXIT_DEGRADED = 3  # a federation run whose steps finished while some site failed or was rejected
EXIT_INTERRUPTED = 130  # a federation run stopped by Ctrl-C or SIGTERM
EXIT_PIPE_CLOSED = 141  # stdout's reader went away (`| head`): a shell's code for SIGPIPE

#: A federation run's status (``metrics.json``) → the exit code of the command that ran it, on
#: either runtime (``flower_runs.exit_code``, ``simulations.local_grid``); an experiment's cell
#: is complete when its run's code is one of ``FINISHED`` (``simulations.cell``).
RUN_EXIT_CODES: dict[str, int] = {COMPLETED: EXIT_OK, DEGRADED: EXIT_DEGRADED, FAILED: EXIT_FAILED}
FINISHED = frozenset({EXIT_OK, EXIT_DEGRADED})  # the run's steps all ended


def run_exit_code(status: object) -> int:
    """The exit code of a run that ended with ``status``: any status the table does not name
    (none: no metrics were written) is a failure."""
    return RUN_EXIT_CODES.get(str(status), EXIT_FAILED)
