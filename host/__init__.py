"""What this machine's operating system says and holds, for the server and the site alike: a
process named robustly to PID reuse (``process_identity``) and the lock files that name their
holder (``locks``). Below every other layer: it imports nothing else of starfed."""
