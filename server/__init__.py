"""The federation, server side: the ServerApp (``app``), the steps driven by a coordinator that
is given its strategy (``coordinator``, ``strategy``), messages to sites (``messaging``), the
federation folder (``federation``), server-side registration and replay (``replay``), the
federation's scores (``scores``). Operations (the SuperLink, the gateway, certificates, site
keys, status) are in ``starfed.server.ops``; serving inference devices in
``starfed.server.serving`` (docs/design.md#the-layout).
"""
