"""Operations, server side: everything of the server that starts, stops or guards processes.

The managed SuperLink (``superlink``), the fleet-only gateway (``gateway``, ``fleet_proxy``),
certificates (``certs``) and site keys by name (``sites``), the server folder (``layout``), the
federation at a glance (``status``) and on a web page (``dashboard``). What the sites' operations
share with these (processes, key files, the clock, exit codes, runs through ``flwr``, Flower's
internals) is ``starfed.ops``. Nothing in the model (``starfed.shared``) or the federation
(``starfed.server``, ``starfed.client``) imports from here (docs/design.md#the-layout).
"""
