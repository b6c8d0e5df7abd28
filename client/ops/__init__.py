"""Operations, site side: the managed SuperNode (``supernode``, with ``site_options``,
``site_processes``, ``supernode_log``) and whether it reaches the server (``dialling``), one
running site per data folder (``data_lock``), the site's own SuperExec (``superexec``) and the
readiness check (``check``) behind ``starfed site``. They share the process and Flower helpers
of ``starfed.ops`` and import nothing from ``starfed.server`` (docs/design.md#the-layout).
"""
