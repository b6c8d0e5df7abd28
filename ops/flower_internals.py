"""Every name starfed takes from a non-public Flower module, and why: the one place to look when
Flower moves.

Flower's public API is ``flwr.app``, ``flwr.clientapp``, ``flwr.serverapp`` (with the strategies
of ``flwr.serverapp.strategy``) and its command-line programs; starfed uses only those, except
for the names below. Each was checked against Flower 1.42.0 (and was the same in 1.41.0); a new
Flower release is checked by reading this module against it, then running the deployed
end-to-end tests (tests/test_e2e_server_run.py, tests/test_deploy_e2e.py).

The site's SuperExec (``starfed.client.ops.superexec``) is Flower's own task loop with a fork
executor (docs/deployment.md), so it needs Flower's pieces of that loop:

- ``RuntimeHttpClient``, ``AcquireTaskRequest``, ``make_simple_http_retry_invoker``: the Runtime
  API client the SuperNode hands its tasks out through (``flwr.supercore.runtime``,
  ``flwr.proto.runtime_pb2``, ``flwr.supercore.retry``).
- ``RuntimeVersionHttpInterceptor``, ``SuperExecAuthHttpInterceptor``,
  ``load_superexec_auth_secret``, ``SUPEREXEC_AUTH_METHODS``: the headers the SuperNode requires
  of a SuperExec, the version and the secret-signed request, on the methods Flower's own
  SuperExec signs (``flwr.supercore.interceptors``, ``flwr.supercore.auth.superexec_secret``,
  ``flwr.supercore.superexec.run_superexec``).
- ``AutoExecPlugin``, ``ExecutionSpec``, ``LaunchResult``, ``TaskType``: the plugin that turns an
  acquired task into a launch, and the ``Executor`` protocol's types the fork executor implements
  (``flwr.supercore.superexec``, ``flwr.supercore.constant``).
- ``run_clientapp``: what ``flwr-clientapp`` runs, called in the forked child
  (``flwr.supernode.runtime.run_clientapp``).

The local runtime (``starfed.simulations.local_grid``) plays the ServerApp process of Flower's
runtime: a ``Message`` can only be made once the process's task identity is set, which the
runtime does before it calls ``main``:

- ``TaskIdentity``, ``SUPERLINK_NODE_ID``: that identity, and the node id a ServerApp sends from
  (``flwr.supercore.task_identity``, ``flwr.common.constant``).

Adopting a registered key (``starfed.server.ops.sites.flower_node_of``): ``flwr supernode list``
shows neither keys nor names, so a key Flower holds but sites.json does not is looked up, read
only, in the SuperLink's database: its ``node`` table's ``node_id``, ``status`` and
``public_key`` (the key's PEM, SubjectPublicKeyInfo) columns (``flwr.supercore.state.schema``;
tests/test_adversarial_sites.py builds the table with Flower's own schema).

Clock skew (``starfed.ops.clock``): Flower refuses a SuperNode whose signed timestamp is
outside its window with the same answer as a removed key (401 "Invalid SuperNode
authentication"), so starfed measures the time difference itself, against the window:

- ``TIMESTAMP_TOLERANCE``, ``SYSTEM_TIME_TOLERANCE``: the window, an age within
  (-SYSTEM_TIME_TOLERANCE, TIMESTAMP_TOLERANCE + SYSTEM_TIME_TOLERANCE) seconds
  (``flwr.common.constant``).

The positional-averaging baseline (``starfed.simulations.methods.positional``) is FedAvg's
reduction without FedAvg's rounds:

- ``aggregate_arrayrecords``: the weighted average inside Flower's ``FedAvg``, so that the
  baseline averages exactly as Flower does (``flwr.serverapp.strategy.strategy_utils``).
"""

from flwr.common.constant import (
    SUPERLINK_NODE_ID,
    SYSTEM_TIME_TOLERANCE,
    TIMESTAMP_TOLERANCE,
)
from flwr.proto.runtime_pb2 import AcquireTaskRequest
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords
from flwr.supercore.auth.superexec_secret import load_superexec_auth_secret
from flwr.supercore.constant import TaskType
from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor, SuperExecAuthHttpInterceptor
from flwr.supercore.retry import make_simple_http_retry_invoker
from flwr.supercore.runtime import RuntimeHttpClient
from flwr.supercore.superexec.executor import ExecutionSpec, LaunchResult
from flwr.supercore.superexec.plugin import AutoExecPlugin
from flwr.supercore.superexec.run_superexec import (
    _SUPEREXEC_AUTH_METHODS as SUPEREXEC_AUTH_METHODS,
)
from flwr.supercore.task_identity import TaskIdentity
from flwr.supernode.runtime.run_clientapp import run_clientapp

__all__ = [
    "SUPEREXEC_AUTH_METHODS",
    "SUPERLINK_NODE_ID",
    "SYSTEM_TIME_TOLERANCE",
    "TIMESTAMP_TOLERANCE",
    "AcquireTaskRequest",
    "AutoExecPlugin",
    "ExecutionSpec",
    "LaunchResult",
    "RuntimeHttpClient",
    "RuntimeVersionHttpInterceptor",
    "SuperExecAuthHttpInterceptor",
    "TaskIdentity",
    "TaskType",
    "aggregate_arrayrecords",
    "load_superexec_auth_secret",
    "make_simple_http_retry_invoker",
    "run_clientapp",
]
