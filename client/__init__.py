"""The federation, site side: the site and its side of every phase (``site``), its memory
(``memory``), and the thin adapters that hand it Flower's messages — the ClientApp (``app``) and
the site worker (``worker``), both through ``answer``. Operations (the managed SuperNode, the
site's SuperExec, the readiness check) are in ``starfed.client.ops`` (docs/design.md#the-layout).
"""
