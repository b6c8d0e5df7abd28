"""The site's SuperExec: Flower's task loop, each ClientApp task in a child forked from it.

Flower 1.42 runs every message a SuperNode receives in a fresh ``flwr-clientapp`` process
(flwrlabs/flower#3670). Importing Flower alone takes that process ≈ 2.7 s on the development
machine, paid on each of a step's six messages per site (docs/benchmarks.md, "Deployed step").
In Flower's ``process`` isolation the SuperNode leaves its tasks to a SuperExec of the
deployment's choosing; this one is Flower's own loop and pieces (the Runtime API client, the
``AutoExecPlugin``, ``run_clientapp``) with one change: the executor — Flower's ``Executor``
protocol, as its subprocess and Kubernetes executors implement it — forks the task's process
from this one, which has imported Flower and the ClientApp already. A forked child starts in
milliseconds and is still one process per task, as Flower expects (it sets globals, signal
handlers and exits through ``flwr_exit``). Fork is safe here: this process runs one thread.

The Runtime API (plain HTTP on 127.0.0.1) is protected with Flower's SuperExec authentication:
``starfed site start`` writes a random secret that only this process and the SuperNode read, so
another local user cannot acquire the site's tasks.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from pathlib import Path

import starfed.client.app  # noqa: F401  imported once here, so that no task imports it again
from starfed.ops.flower_internals import (
    SUPEREXEC_AUTH_METHODS,
    AcquireTaskRequest,
    AutoExecPlugin,
    ExecutionSpec,
    LaunchResult,
    RuntimeHttpClient,
    RuntimeVersionHttpInterceptor,
    SuperExecAuthHttpInterceptor,
    TaskType,
    load_superexec_auth_secret,
    make_simple_http_retry_invoker,
    run_clientapp,
)

#: What this SuperExec executes: a SuperNode sends nothing else.
TASK_TYPES = frozenset({TaskType.CLIENT_APP})
#: Flower's SuperNode makes a task acquirable before it has pulled the message's objects from the
#: SuperLink; a child that asks for them at once finds them missing and Flower backs off a whole
#: second (``PULL_INITIAL_BACKOFF``). ``flwr-clientapp`` never noticed: its start took longer.
OBJECTS_GRACE_S = 0.1


class ForkExecutor:
    """Flower's ``Executor`` protocol: one forked child per task, reaped between polls."""

    def __init__(self) -> None:
        self.children: set[int] = set()

    def get_eligible_capacity(
        self, supported_task_types: set[TaskType], **_: object
    ) -> tuple[set[TaskType], set[str]]:
        return supported_task_types & TASK_TYPES, set()

    def wait_for_capacity(self, *_: object, **__: object) -> None:
        """No capacity gate: Flower's SuperNode hands out one task at a time."""

    def launch(self, spec: ExecutionSpec) -> LaunchResult:
        if spec.task_type not in TASK_TYPES:
            return LaunchResult.failed(f"this SuperExec runs ClientApps only, not {spec.task_type}")
        pid = os.fork()
        if pid == 0:  # the child: Flower's ClientApp process, minus the start-up
            _run_task(spec)
        self.children.add(pid)
        return LaunchResult.accepted()

    def reconcile(self) -> None:
        for pid in list(self.children):
            if os.waitpid(pid, os.WNOHANG)[0]:
                self.children.discard(pid)

    def close(self) -> None:
        for pid in self.children:
            os.kill(pid, signal.SIGTERM)


def _run_task(spec: ExecutionSpec) -> None:
    """What ``flwr-clientapp`` does with these arguments; never returns."""
    code = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        time.sleep(OBJECTS_GRACE_S)
        run_clientapp(
            runtime_api_address=spec.runtime_api_address,
            token=spec.token,
            insecure=spec.insecure,
            parent_pid=spec.parent_pid,
            runtime_dependency_install=spec.runtime_dependency_install,
        )
        code = 0
    except SystemExit as done:  # run_clientapp ends through flwr_exit
        code = done.code if isinstance(done.code, int) else 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve(runtime_api_address: str, secret_file: Path, poll_s: float) -> None:
    """Acquire the SuperNode's tasks and fork one child each, until the parent goes away."""
    parent = os.getppid()
    secret = load_superexec_auth_secret(str(secret_file))
    assert secret is not None  # None only when no file is named
    client = RuntimeHttpClient.from_server_address(
        server_address=runtime_api_address,
        insecure=True,  # the SuperNode's Runtime API listens on 127.0.0.1 only
        root_certificates=None,
        interceptors=[
            RuntimeVersionHttpInterceptor(component_name="SuperExec"),
            SuperExecAuthHttpInterceptor(
                master_secret=secret,
                protected_methods=SUPEREXEC_AUTH_METHODS,
            ),
        ],
        retry_invoker=make_simple_http_retry_invoker(),
    )
    executor = ForkExecutor()
    plugin = AutoExecPlugin(
        runtime_api_address=runtime_api_address,
        insecure=True,
        root_certificates_path=None,
        runtime_dependency_install=False,
        executor=executor,
    )
    try:
        while os.getppid() == parent:
            executor.reconcile()
            types, fab_hashes = executor.get_eligible_capacity(set(plugin.supported_task_types))
            reply = client.AcquireTask(
                AcquireTaskRequest(supported_task_types=types, agentapp_fab_hashes=fab_hashes)
            )
            if reply.HasField("task") and reply.token:
                result = plugin.launch_task(token=reply.token, task=reply.task)
                if result.message:
                    print(
                        f"starfed superexec: task {reply.task.task_id}: {result.message}",
                        file=sys.stderr,
                        flush=True,
                    )
                continue
            time.sleep(poll_s)
    finally:
        executor.close()
        client.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m starfed.client.ops.superexec", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--runtime-api-address", required=True, help="the SuperNode's HOST:PORT")
    parser.add_argument(
        "--secret-file",
        type=Path,
        required=True,
        help="the SuperExec secret the SuperNode was given",
    )
    parser.add_argument("--poll-s", type=float, default=0.05, help="seconds between polls")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with contextlib.suppress(KeyboardInterrupt):
        serve(args.runtime_api_address, args.secret_file, args.poll_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
