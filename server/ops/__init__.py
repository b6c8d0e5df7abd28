"""Operations, server side, and what a site's operations share with it: everything that starts,
stops or guards processes.

The managed SuperLink (``superlink``), the fleet-only gateway (``gateway``), certificates
(``certs``) and site keys (``pki``, ``sites``), the server folder (``layout``), the federation at
a glance (``status``); and, used by ``starfed.client.ops`` and ``starfed.simulations`` too,
processes ended by PID (``processes``), runs submitted and followed through ``flwr``
(``flower_runs``) and the one module that imports Flower's non-public modules
(``flower_internals``). Nothing in the model (``starfed.shared``) or the federation
(``starfed.server``, ``starfed.client``) imports from here (docs/design.md#the-layout).
"""
