"""A KubernetesExecutor pod's process model, without a cluster.

A pod here is what a KubernetesExecutor worker pod's container is, process for process:
``dumb-init`` (Debian's; the image's entrypoint, setsid mode: it forwards signals to its child's
process group) as PID 1 of a fresh PID namespace (``unshare --pid --fork --mount-proc``), running
``python -m airflow.sdk.execution_time.execute_workload --json-string <workload>`` (the pod
template's command, cncf-kubernetes ``pod_generator.py``): the Task SDK supervisor, which forks
the task runner into its own process group and talks to the real API server. When PID 1 of a PID
namespace dies the kernel SIGKILLs everything left in it: that is the container's end, and "SIGKILL
to every process of the container" is the namespace's death, as on a node.

What the kubelet does to a pod, and the harness with it:

- delete / drain: SIGTERM to PID 1, then, if PID 1 is still there after the grace
  (``terminationGracePeriodSeconds``: 30 s in the executor's template; a drain may use less),
  SIGKILL to PID 1 (so to the namespace). What was still in the namespace just before that
  SIGKILL is recorded (:attr:`PodEnd.left`);
- ``preStop`` exec hook: a command run inside the container before the SIGTERM;
- OOM kill: SIGKILL to one process of the container (usually the biggest: the task runner);
- node loss: SIGKILL to PID 1 at once.

:class:`Kubelet` watches the :mod:`tests.e2e.pod_executor` hand-off directory, starts one pod
per workload (one per try: a retry gets a new pod, as on Kubernetes) and reports each pod's end
back to the executor, as the KubernetesExecutor's pod watcher does.
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.e2e.airflow_stack import wait_until
from tests.e2e.pod_executor import pod_dir
from tests.e2e.procs import PROC, ancestors, cmdline, is_alive

DUMB_INIT = "/usr/bin/dumb-init"
#: How often the harness looks at the namespace while a pod is being terminated.
POLL_S = 0.01


class SupervisorMode(enum.Enum):
    """How the pod's supervisor treats the SIGTERM dumb-init forwards to it."""

    #: task-sdk 1.3.2: ``_forward_signal`` sends it on to the task process.
    FORWARDING = "airflow.sdk.execution_time.execute_workload"
    #: apache/airflow#69034: a warm shutdown, nothing is forwarded (``tests/e2e/pod_supervisor.py``).
    WARM = "tests.e2e.pod_supervisor"


@dataclass
class PodEnd:
    """How a pod ended, as the kubelet saw it."""

    how: str
    #: Seconds from the first signal (or kill) to PID 1's exit.
    took_s: float = 0.0
    #: PID 1 exited by itself (its supervisor finished) before the grace ran out.
    by_itself: bool = False
    #: Processes other than PID 1 still in the namespace at the moment it was SIGKILLed
    #: (empty when PID 1 exited by itself first): host pid -> cmdline.
    left: dict[int, str] = field(default_factory=dict)
    #: Of the processes in the pod at the first signal, when each was seen gone (host pid ->
    #: seconds after that signal, polled every :data:`POLL_S`; absent: it was still there when
    #: the namespace was SIGKILLed).
    gone: dict[int, float] = field(default_factory=dict)
    exit_code: int | None = None


class RestrictedPods:
    """What makes a pod an unprivileged one (``tests/process/restricted_pod.py``): its processes
    run as uid 50000 with no capabilities, ``no_new_privs`` and the container runtime's default
    seccomp profile. ``AIRFLOW_HOME`` (under pytest's root-only temp folder) is shown to it at a path of
    its own; its logs and the test's state folder become writable by anyone; its ``HOME`` holds a
    planted secret (``.aws/credentials``)."""

    def __init__(self, airflow_home: Path, state_dir: Path) -> None:
        from tests.process.restricted_pod import make_pod_dir

        self.root = make_pod_dir()
        self.home = self.root / "home"
        self.airflow_home, self.shown_at = airflow_home, self.root / "airflow_home"
        self.shown_at.mkdir(mode=0o755)
        airflow_home.chmod(0o755)
        for folder in (airflow_home / "logs", state_dir):
            folder.mkdir(exist_ok=True)
            folder.chmod(0o1777)
        # The image's user: Airflow refuses to run as a uid without a name.
        self.passwd = self.root / "passwd"
        self.passwd.write_text(Path("/etc/passwd").read_text() + "airflow:x:50000:0::/home/airflow:/bin/sh\n")
        self.passwd.chmod(0o644)

    def argv(self, argv: list[str]) -> list[str]:
        from tests.process.restricted_pod import restricted_argv

        binds = {str(self.airflow_home): str(self.shown_at), str(self.passwd): "/etc/passwd"}
        return restricted_argv(argv, binds=binds)

    def env(self, env: dict[str, str]) -> dict[str, str]:
        """The pod's environment: its paths into ``AIRFLOW_HOME`` through where it is shown."""
        moved = {k: v.replace(str(self.airflow_home), str(self.shown_at)) for k, v in env.items()}
        return {
            **moved,
            "HOME": str(self.home),
            "USER": "airflow",
            "LOGNAME": "airflow",
            "E2E_POD_RESTRICTED": "1",
        }

    def close(self) -> None:
        import shutil

        shutil.rmtree(self.root, ignore_errors=True)


class Pod:
    """One pod: ``unshare`` -> ``dumb-init`` (PID 1 of the new namespace) -> the supervisor."""

    def __init__(
        self,
        name: str,
        workload_json: str,
        env: dict[str, str],
        mode: SupervisorMode,
        log_path: Path,
        restricted: RestrictedPods | None = None,
    ) -> None:
        self.name, self.mode, self.log_path = name, mode, log_path
        container = [DUMB_INIT, "--", sys.executable, "-m", mode.value, "--json-string", workload_json]
        if restricted is not None:
            container, env = restricted.argv(container), restricted.env(env)
        argv = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", *container]
        with log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                argv,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.pid1 = wait_until(self._find_pid1, 10, f"pod {name}'s PID 1", interval=0.01)
        self.namespace = os.readlink(PROC / str(self.pid1) / "ns" / "pid")
        self.started = time.monotonic()
        self.end: PodEnd | None = None
        self._ended = threading.Event()

    def _find_pid1(self) -> int | None:
        """unshare's forked child: it execs dumb-init as PID 1 of the new namespace."""
        with contextlib.suppress(OSError):
            children = (PROC / str(self.proc.pid) / "task" / str(self.proc.pid) / "children").read_text()
            for pid in map(int, children.split()):
                if "dumb-init" in cmdline(pid):
                    return pid
        return None

    # -- looking inside ---------------------------------------------------------------------

    def members(self) -> dict[int, str]:
        """Live processes of the pod (host pid -> cmdline), PID 1 included.

        A process in a PID namespace nested in the pod's (a bubblewrap sandbox's) is in the pod
        too: the kernel kills it with the pod's namespace. Its own namespace link differs, so it
        is found by descent from PID 1: nothing in a PID namespace can be reparented out of it."""
        found = {}
        for entry in PROC.iterdir():
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            with contextlib.suppress(OSError):
                inside = os.readlink(entry / "ns" / "pid") == self.namespace or self.pid1 in ancestors(pid)
                if inside and is_alive(pid):
                    found[pid] = cmdline(pid)
        return found

    def host_pid(self, pod_pid: int) -> int:
        """The host pid of the process the pod knows as ``pod_pid``.

        ``NSpid`` (/proc status) lists a process's pid in each namespace from ours down; the pod's
        is at PID 1's depth, not last: a sandbox's processes have one more, their own."""
        depth = len(_ns_pids(self.pid1)) - 1
        for pid in self.members():
            with contextlib.suppress(OSError, IndexError):
                if _ns_pids(pid)[depth] == pod_pid:
                    return pid
        raise LookupError(f"no process {pod_pid} in pod {self.name}")

    def alive(self) -> bool:
        return is_alive(self.pid1)

    # -- what the kubelet does --------------------------------------------------------------

    def terminate(self, grace: float, how: str) -> PodEnd:
        """Pod deletion or a drain: SIGTERM to PID 1, SIGKILL to the namespace after ``grace`` s."""
        present = set(self.members())
        begun = time.monotonic()
        os.kill(self.pid1, signal.SIGTERM)
        gone: dict[int, float] = {}
        while self.alive() and time.monotonic() - begun < grace:
            time.sleep(POLL_S)
            now = time.monotonic() - begun
            gone.update((pid, now) for pid in present - gone.keys() if not is_alive(pid))
        if not self.alive():
            end = PodEnd(how, time.monotonic() - begun, by_itself=True, gone=gone)
            return self._ended_as(end)
        left = {pid: line for pid, line in self.members().items() if pid != self.pid1}
        end = self._kill_namespace(how, begun, left)
        end.gone = gone
        return end

    def lose_node(self) -> PodEnd:
        """Node loss: everything in the pod dies at once, nothing runs."""
        left = {pid: line for pid, line in self.members().items() if pid != self.pid1}
        return self._kill_namespace("node loss", time.monotonic(), left)

    def oom_kill(self, host_pid: int) -> None:
        """The kernel's OOM killer: SIGKILL to one process of the container."""
        assert host_pid in self.members(), f"{host_pid} is not in pod {self.name}"
        os.kill(host_pid, signal.SIGKILL)

    def pre_stop(self, command: str, timeout: float = 10.0) -> subprocess.CompletedProcess[bytes]:
        """A ``preStop`` exec hook: ``sh -c COMMAND`` inside the container's namespaces."""
        return subprocess.run(
            ["nsenter", "-t", str(self.pid1), "-p", "-m", "/bin/sh", "-c", command],
            capture_output=True,
            timeout=timeout,
            check=True,
        )

    def _kill_namespace(self, how: str, begun: float, left: dict[int, str]) -> PodEnd:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid1, signal.SIGKILL)
        self.wait(10)
        return self._ended_as(PodEnd(how, time.monotonic() - begun, by_itself=False, left=left))

    def _ended_as(self, end: PodEnd) -> PodEnd:
        self.wait(10)
        end.exit_code = self.proc.returncode
        self.end = end
        return end

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def destroy(self) -> None:
        """Teardown: whatever is left of the pod goes (by its PID 1, so the namespace with it)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid1, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        if self.proc.poll() is None:
            self.proc.kill()


def _ns_pids(pid: int) -> list[int]:
    """``NSpid`` of ``pid``: its pid in our PID namespace, then in each nested one down to its own."""
    for line in (PROC / str(pid) / "status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return [int(n) for n in line.split()[1:]]
    raise LookupError(f"no NSpid for {pid}")


class Kubelet:
    """Starts a pod for each workload the :class:`~tests.e2e.pod_executor.PodExecutor` queues.

    :param mode_of: the supervisor mode for a run (by its run id).
    """

    def __init__(
        self,
        state_dir: Path,
        env: dict[str, str],
        mode_of: Callable[[str], SupervisorMode],
        log_dir: Path,
        restricted: Callable[[str], RestrictedPods | None] = lambda run_id: None,
    ) -> None:
        self._restricted = restricted
        root = pod_dir(state_dir)
        self._queue, self._exits = root / "queue", root / "exit"
        self._queue.mkdir(parents=True, exist_ok=True)
        self._exits.mkdir(parents=True, exist_ok=True)
        self._env, self._mode_of, self._log_dir = env, mode_of, log_dir
        self.pods: dict[tuple[str, int], Pod] = {}
        self._started: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._watch, name="kubelet", daemon=True)

    def __enter__(self) -> Kubelet:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        with self._lock:
            pods = list(self.pods.values())
        for pod in pods:
            pod.destroy()

    def pod(self, run_id: str, try_number: int, timeout: float = 120) -> Pod:
        """The pod of that try (waits until the scheduler queued it and it started)."""
        return wait_until(
            lambda: self._get(run_id, try_number),
            timeout,
            f"the pod of {run_id} try {try_number}",
            interval=0.05,
        )

    def _get(self, run_id: str, try_number: int) -> Pod | None:
        with self._lock:
            return self.pods.get((run_id, try_number))

    def _watch(self) -> None:
        while not self._stop.wait(0.05):
            for path in sorted(self._queue.glob("*.json")):
                if path.stem not in self._started:
                    self._started.add(path.stem)
                    try:
                        self._start(path)
                    except BaseException as exc:  # kept for the tests' diagnostics
                        self.errors.append(exc)

    def _start(self, path: Path) -> None:
        workload_json = path.read_text()
        ti = json.loads(workload_json)["ti"]
        name = f"{ti['dag_id']}.{ti['run_id']}.try{ti['try_number']}"
        pod = Pod(
            name,
            workload_json,
            self._env,
            self._mode_of(ti["run_id"]),
            self._log_dir / f"pod-{name}.log",
            self._restricted(ti["run_id"]),
        )
        with self._lock:
            self.pods[(ti["run_id"], ti["try_number"])] = pod
        threading.Thread(target=self._report_end, args=(pod, path.stem), daemon=True).start()

    def _report_end(self, pod: Pod, ti_id: str) -> None:
        """When the pod is gone, tell the executor how it ended (the pod watcher's event)."""
        exit_code = pod.proc.wait()
        tmp = self._exits / f"{ti_id}.tmp"
        tmp.write_text(json.dumps({"exit_code": exit_code}))
        tmp.replace(self._exits / f"{ti_id}.json")
