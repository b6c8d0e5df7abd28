"""The exit codes of every starfed command, one name each
(docs/federation.md#statuses-and-exit-codes).

Every command exits 0 when done, 1 when something failed and 2 for bad input (one line, before
anything heavy runs). Commands that run a federation (`simulate`, `server round`, `server
resume`) end with the run's status — completed 0, failed 1, degraded 3 — and 130 when Ctrl-C or
SIGTERM stopped the run (as a shell reports Ctrl-C). They live with the operations code because
`simulations/` and `cli/` both return them.
"""

EXIT_OK = 0  # done; a federation run: completed
EXIT_FAILED = 1  # something failed: a process would not start, a peer refused, the run failed
EXIT_BAD_INPUT = 2  # arguments, files, names: one line, before anything heavy runs
EXIT_DEGRADED = 3  # a federation run whose steps finished while some site failed or was rejected
EXIT_INTERRUPTED = 130  # a federation run stopped by Ctrl-C or SIGTERM
