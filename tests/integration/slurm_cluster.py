"""A real Slurm cluster on this one machine, for testing `multinode_trainer.slurm`.

One slurmctld in the root network namespace and N slurmd daemons, each in its own network and
UTS namespace with its own hostname (`n1`, `n2`, …) and address (198.18.0.11, .12, …, a range
reserved for network tests by RFC 2544) on a veth pair attached to a bridge. Every node sees
the same filesystem, as nodes sharing a parallel filesystem do.

It needs root. `start()` installs Debian's `slurm-wlm` and `munge` when they are missing, starts
munged (unless one runs already), writes a private slurm.conf (clients find it through
$SLURM_CONF, /etc/slurm is not touched), adds the node names to /etc/hosts and brings the
daemons up. `stop()` cancels the jobs, kills only the processes it started (everything inside
its namespaces, its slurmctld and its munged), deletes the namespaces and the bridge, and
removes its lines from /etc/hosts.

Facts this is built on (Slurm 22.05 on Debian 12, no systemd): `ip netns exec` remounts /sys and
slurmd then finds no cgroup filesystem, so the daemons enter the namespace with `nsenter` and
`unshare --uts`; node names must resolve to the node's own address, or torch's c10d rendezvous
finds no host for its store; `sbatch --wait` polls slowly, so jobs are polled with squeue.

By hand: `python tests/integration/slurm_cluster.py [WORKDIR]` keeps a cluster up until Ctrl-C.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

HOSTS_MARK = "# titanlab-slurm-test-cluster"
SUBNET = "198.18.0"
BRIDGE = "tlslurm_br"
CTLD_PORT = 16817  # not Slurm's default, so a real slurmctld on this machine is left alone
MARK_ENV = "TITANLAB_SLURM_TEST_CLUSTER"  # in the environment of every daemon this module starts
MUNGED_RECORD = "/run/titanlab-slurm-test-munged.pid"  # the munged this module started
PACKAGES = ["slurm-wlm", "munge"]
BINARIES = ["slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "munged"]


def _run(
    *cmd: str,
    check: bool = True,
    env: dict | None = None,
    timeout: float = 60,
) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None and not os.path.exists(f"/usr/sbin/{b}")]


def install_packages() -> None:
    """Install slurm-wlm and munge from Debian's packages (refreshing the index if needed)."""
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    if subprocess.run(cmd, env=env, capture_output=True, timeout=600).returncode != 0:
        _run("apt-get", "update", "-q", env=env, timeout=300)
        _run(*cmd, env=env, timeout=600)


class SlurmTestCluster:
    """`start()`, then `submit(...)` / `wait(job)`, then `stop()` (always, e.g. from a finally)."""

    def __init__(self, workdir: str, nodes: int = 2, cpus_per_node: int = 2) -> None:
        self.workdir = os.path.abspath(workdir)
        self.names = [f"n{i}" for i in range(1, nodes + 1)]
        self.cpus_per_node = cpus_per_node
        self.conf = os.path.join(self.workdir, "slurm.conf")
        self.env = dict(os.environ, SLURM_CONF=self.conf, **{MARK_ENV: "1"})
        self._procs: list[subprocess.Popen] = []
        self._munged_pid: int | None = None
        self._netns: list[str] = []
        self._bridge = False
        self._hosts_added = False

    # ---- set-up ---------------------------------------------------------------------------
    def start(self) -> SlurmTestCluster:
        if os.geteuid() != 0:
            raise RuntimeError(
                "the Slurm test cluster needs root (it installs packages, creates "
                "network namespaces and edits /etc/hosts)"
            )
        if missing_binaries():
            install_packages()
            if missing := missing_binaries():
                raise RuntimeError(f"installing {PACKAGES} did not provide {missing}")
        for sub in ("state", "log", "run", *(f"spool/{n}" for n in self.names)):
            os.makedirs(os.path.join(self.workdir, sub), exist_ok=True)
        try:
            self._remove_leftovers()
            self._start_munge()
            self._make_network()
            self._add_hosts()
            self._write_conf()
            self._start_daemons()
            self._wait_idle()
        except BaseException:
            self.stop()
            raise
        return self

    def _remove_leftovers(self) -> None:
        """Remove what an earlier cluster of this module left when its process was killed."""
        self._kill([pid for pid in _pids() if f"{MARK_ENV}=1" in _environ(pid)])
        if os.path.exists(MUNGED_RECORD):  # adopt it: stopped with this cluster
            with open(MUNGED_RECORD) as f:
                pid = int(f.read().strip() or 0)
            if pid and os.path.exists(f"/proc/{pid}"):
                self._munged_pid = pid
            else:
                os.remove(MUNGED_RECORD)
        for line in _run("ip", "netns", "list").stdout.splitlines():
            ns = line.split()[0] if line.strip() else ""
            if ns.startswith("tlslurm_"):
                self._kill(_run("ip", "netns", "pids", ns, check=False).stdout.split())
                _run("ip", "netns", "del", ns, check=False)
        # Links left in this namespace: the bridge, and veth pairs made before their node end
        # moved into a namespace (a kill between the two steps).
        for line in _run("ip", "-o", "link", "show").stdout.splitlines():
            name = line.split(":")[1].strip().split("@")[0] if line.count(":") >= 2 else ""
            if name.startswith("tlslurm"):
                _run("ip", "link", "del", name, check=False)
        self._hosts_added = True  # drop any of our lines still in /etc/hosts
        self._restore_hosts()

    def _start_munge(self) -> None:
        if (
            self._munged_pid is not None
            or _run("pgrep", "-x", "munged", check=False).returncode == 0
        ):
            return  # ours from a killed run, or the machine's own (which serves us too; not ours to stop)
        os.makedirs("/run/munge", exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        _run("su", "-s", "/bin/sh", "munge", "-c", "/usr/sbin/munged")
        with open("/run/munge/munged.pid") as f:
            self._munged_pid = int(f.read().strip())
        with open(MUNGED_RECORD, "w") as f:
            f.write(f"{self._munged_pid}\n")

    def _make_network(self) -> None:
        _run("ip", "link", "add", BRIDGE, "type", "bridge")
        self._bridge = True
        _run("ip", "addr", "add", f"{SUBNET}.1/24", "dev", BRIDGE)
        _run("ip", "link", "set", BRIDGE, "up")
        for i, name in enumerate(self.names, start=1):
            ns, host_end, node_end = f"tlslurm_{name}", f"tlslurm{i}h", f"tlslurm{i}n"
            _run("ip", "netns", "add", ns)
            self._netns.append(ns)
            _run("ip", "link", "add", host_end, "type", "veth", "peer", "name", node_end)
            _run("ip", "link", "set", node_end, "netns", ns)
            _run("ip", "link", "set", host_end, "master", BRIDGE, "up")
            inside = ("ip", "netns", "exec", ns, "ip")
            _run(*inside, "addr", "add", f"{SUBNET}.{10 + i}/24", "dev", node_end)
            _run(*inside, "link", "set", node_end, "up")
            _run(*inside, "link", "set", "lo", "up")

    def _add_hosts(self) -> None:
        lines = [f"{SUBNET}.{10 + i} {name} {HOSTS_MARK}" for i, name in enumerate(self.names, 1)]
        with open("/etc/hosts", "a") as f:  # in place: /etc/hosts may be a bind mount
            f.write("\n".join(lines) + "\n")
        self._hosts_added = True

    def _write_conf(self) -> None:
        wd, host = self.workdir, socket.gethostname().split(".")[0]
        nodes = "\n".join(
            f"NodeName={n} NodeHostname={n} NodeAddr={SUBNET}.{10 + i} CPUs={self.cpus_per_node} "
            f"RealMemory=4000 State=UNKNOWN"
            for i, n in enumerate(self.names, 1)
        )
        with open(self.conf, "w") as f:
            f.write(f"""ClusterName=titanlabtest
SlurmctldHost={host}({SUBNET}.1)
SlurmctldPort={CTLD_PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
ReturnToService=2
MailProg=/bin/true
KillWait=30
StateSaveLocation={wd}/state
SlurmctldPidFile={wd}/run/slurmctld.pid
SlurmctldLogFile={wd}/log/slurmctld.log
SlurmdSpoolDir={wd}/spool/%n
SlurmdPidFile={wd}/run/slurmd-%n.pid
SlurmdLogFile={wd}/log/slurmd-%n.log
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")

    def _start_daemons(self) -> None:
        def spawn(cmd: list[str], log: str) -> None:
            with open(os.path.join(self.workdir, "log", log), "w") as out:
                self._procs.append(
                    subprocess.Popen(
                        cmd,
                        env=self.env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                )

        spawn(["/usr/sbin/slurmctld", "-D", "-c", "-i"], "slurmctld.out")
        for name, ns in zip(self.names, self._netns):
            spawn(
                [
                    "nsenter",
                    f"--net=/run/netns/{ns}",
                    "unshare",
                    "--uts",
                    "sh",
                    "-c",
                    f"hostname {name} && exec /usr/sbin/slurmd -D -N {name}",
                ],
                f"slurmd-{name}.out",
            )

    def _wait_idle(self, timeout: float = 60) -> None:
        end = time.time() + timeout
        states = ""
        while time.time() < end:
            for p in self._procs:
                if p.poll() is not None:
                    raise RuntimeError(
                        f"{p.args[0]} exited with {p.returncode}; see {self.workdir}/log"
                    )
            proc = _run("sinfo", "-h", "-N", "-o", "%N %T", check=False, env=self.env)
            states = proc.stdout.strip()
            if proc.returncode == 0 and states.count("idle") == len(self.names):
                return
            time.sleep(0.3)
        raise RuntimeError(
            f"nodes not idle after {timeout:.0f} s: {states!r}; see {self.workdir}/log"
        )

    # ---- jobs -----------------------------------------------------------------------------
    def submit(
        self,
        script: str,
        *args: str,
        sbatch_args: list[str] = (),
        cwd: str,
        env: dict | None = None,
    ) -> int:
        """`sbatch` the script with `args`; returns the job id."""
        proc = subprocess.run(
            ["sbatch", "--parsable", *sbatch_args, script, *args],
            cwd=cwd,
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=60,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"sbatch failed ({proc.returncode}): {proc.stderr.strip()}")
        return int(proc.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, NodeList, Restarts, …)."""
        out = _run("scontrol", "show", "job", "-o", str(job_id), env=self.env).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait(self, job_id: int, timeout: float = 600, until: str = "done") -> dict[str, str]:
        """Poll until the job has left the queue (or, with until="running", started running)."""
        end = time.time() + timeout
        while time.time() < end:
            info = self.job(job_id)
            state = info.get("JobState", "")
            if until == "running" and state == "RUNNING":
                return info
            if state in (
                "COMPLETED",
                "FAILED",
                "CANCELLED",
                "TIMEOUT",
                "NODE_FAIL",
                "OUT_OF_MEMORY",
                "BOOT_FAIL",
                "DEADLINE",
                "PREEMPTED",
            ):
                return info
            time.sleep(0.5)
        raise TimeoutError(
            f"job {job_id} still {self.job(job_id).get('JobState')} after {timeout:.0f} s"
        )

    def signal(self, job_id: int, sig: str, *, batch: bool = False) -> None:
        """Send `sig` to the job's steps, or with batch=True to its batch script only."""
        _run(
            "scancel", f"--signal={sig}", *(["--batch"] if batch else []), str(job_id), env=self.env
        )

    def control(self, *args: str) -> str:
        """`scontrol ARGS` against this cluster; returns its output."""
        return _run("scontrol", *args, env=self.env).stdout

    # ---- tear-down ------------------------------------------------------------------------
    def stop(self) -> None:
        """Undo everything `start()` did; safe to call more than once and after a failed start."""
        if self._procs:
            jobs = _run("squeue", "-h", "-o", "%i", check=False, env=self.env).stdout.split()
            if jobs:
                _run("scancel", *jobs, check=False, env=self.env)
        for ns in self._netns:  # slurmd, slurmstepd and every job process live inside
            self._kill(_run("ip", "netns", "pids", ns, check=False).stdout.split())
        for p in self._procs:
            if p.poll() is None:
                p.terminate()
        for p in self._procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._procs = []
        if self._munged_pid is not None:
            self._kill([str(self._munged_pid)])
            self._munged_pid = None
            if os.path.exists(MUNGED_RECORD):
                os.remove(MUNGED_RECORD)
        for ns in self._netns:
            _run("ip", "netns", "del", ns, check=False)  # deletes both ends of its veth pair
        self._netns = []
        if self._bridge:
            _run("ip", "link", "del", BRIDGE, check=False)
            self._bridge = False
        self._restore_hosts()

    def _restore_hosts(self) -> None:
        if self._hosts_added:
            with open("/etc/hosts") as f:
                lines = f.readlines()
            kept = [line for line in lines if HOSTS_MARK not in line]
            if kept != lines:
                with open("/etc/hosts", "w") as f:
                    f.writelines(kept)
            self._hosts_added = False

    @staticmethod
    def _kill(pids: list[str], grace: float = 10) -> None:
        alive = []
        for pid in map(int, pids):
            try:
                os.kill(pid, signal.SIGTERM)
                alive.append(pid)
            except ProcessLookupError:
                pass
        end = time.time() + grace
        while alive and time.time() < end:
            alive = [p for p in alive if os.path.exists(f"/proc/{p}") and not _is_zombie(p)]
            time.sleep(0.2)
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _pids() -> list[str]:
    return [p for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]


def _environ(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


if __name__ == "__main__":
    wd = sys.argv[1] if len(sys.argv) > 1 else "/tmp/titanlab-slurm"
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM tears down too
    cluster = SlurmTestCluster(wd).start()
    print(f"cluster up: export SLURM_CONF={cluster.conf}   (Ctrl-C tears it down)", flush=True)
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
