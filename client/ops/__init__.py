"""Operations, site side: the managed SuperNode (``supernode``, with ``site_options``,
``site_processes``, ``supernode_log``), the site's own SuperExec
(``superexec``) and the readiness check (``check``) behind ``starfed site``. They share the
process and Flower helpers of ``starfed.server.ops`` (docs/design.md#the-layout).
"""
