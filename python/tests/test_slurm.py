"""Motley inside a real Slurm allocation (docs/slurm.md), through `sbatch` and the shipped
deploy/slurm/motley.sbatch, as an unprivileged user (nobody): the coordinator and the agent run
without root, a job trains to its end with the single process's losses, Slurm's warning signal
saves the job and exits 75, Slurm requeues it (RequeueExit=75), and the requeued run resumes from
the saved step with the uninterrupted run's losses; a bad job file fails with exit 2.

The set-up is this machine as a two-node Slurm cluster: munged, slurmctld and two slurmd
(`slurmd -N a0`, `-N b0`, each a node of its own partition, pa and pb) started here (as root)
from a generated slurm.conf in a scratch directory, and stopped afterwards. A heterogeneous job
takes a node of each partition. Debian's slurm-wlm and munge provide them (.ci/run installs them
where missing)."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from launcher import DATA, REPO, free_port, motley_bin, reference_losses
from test_recovery import rank0_losses as launch_losses
from tolerance import assert_steps_close, layers_of

MODEL = DATA / "tiny-dev.yaml"
GLOBAL_BATCH = 8
SEED = 5
USER = "nobody"
# The two nodes this machine plays (slurmd -N), each the only node of its partition (pa, pb).
NODES = ("a0", "b0")
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "squeue", "scancel", "srun")
# Slurm's wait before a requeued job may start again is the credential lifetime (cred_expire,
# 120 s by default): 10 s here, so the test does not wait two minutes.
CRED_EXPIRE_S = 10


def missing() -> list:
    gone = [b for b in DAEMONS + CLIENTS if shutil.which(b) is None and not Path(f"/usr/sbin/{b}").exists()]
    if os.geteuid() != 0:
        gone.append("root (the test starts slurmctld, slurmd and munged)")
    try:
        pwd.getpwnam(USER)
    except KeyError:
        gone.append(f"the user {USER}")
    return gone


def need_slurm():
    gone = missing()
    if gone:
        why = f"a two-node Slurm on this machine needs {', '.join(gone)} (Debian: apt-get install slurm-wlm munge; .ci/run does)"
        if os.environ.get("CI"):
            pytest.fail(why)  # CI runs every test: a missing piece fails, never skips
        pytest.skip(why)


def sbin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class Slurm:
    """munged, slurmctld and slurmd for this one machine, and an install of Motley that the
    unprivileged user can reach (the checkout and the venv may sit in root's 0700 home)."""

    def __init__(self):
        self.root = Path(tempfile.mkdtemp(prefix="motley-slurm-", dir="/tmp"))
        self.root.chmod(0o755)
        for d in ("munge", "run", "state", "spool", "log", "bin", "python"):
            (self.root / d).mkdir()
        (self.root / "munge").chmod(0o700)
        (self.root / "run").chmod(0o755)
        self.procs = []
        self.conf = self.root / "slurm.conf"
        self.env = {"PATH": "/usr/sbin:/usr/bin:/bin", "SLURM_CONF": str(self.conf), "LANG": "C.UTF-8"}
        self.install()
        self.start()

    def install(self):
        b = motley_bin()
        assert b is not None, "no motley binary: set MOTLEY_BIN (python/run-tests does) or build target/ci/motley"
        for name in ("motley", "motley-coordinator", "motley-agent"):
            shutil.copy2(Path(b).with_name(name), self.root / "bin" / name)
            (self.root / "bin" / name).chmod(0o755)
        shutil.copytree(REPO / "python" / "motley_torch", self.root / "python" / "motley_torch",
                        ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy2(REPO / "deploy" / "slurm" / "motley.sbatch", self.root / "motley.sbatch")
        # The venv by hard links (no bytes copied; a copy where /tmp is another file system): the
        # same files, in a directory the user can reach. Its python finds its packages from its
        # own path (pyvenv.cfg beside bin/).
        venv = Path(sys.prefix).resolve()
        assert (venv / "pyvenv.cfg").exists(), f"the tests' Python is not a venv's ({venv}): {USER} needs a venv with torch"
        link = "-al" if os.stat(venv).st_dev == os.stat(self.root).st_dev else "-a"
        subprocess.run(["cp", link, str(venv), str(self.root / "venv")], check=True)
        assert not (self.root / "venv").is_symlink() and (self.root / "venv").stat().st_ino != venv.stat().st_ino
        self.reachable_interpreter(venv)
        for p in [self.root / "python", *(self.root / "python").rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)

    def reachable_interpreter(self, venv: Path):
        """Point the linked venv at an interpreter the user can run: the venv's own where the
        user reaches it, else the system's of the same version (a pyenv Python under root's home
        is not reachable, nor is its libpython). The venv's files are the original's (hard
        links): pyvenv.cfg and the link are replaced, never written through."""
        real = Path(os.path.realpath(venv / "bin" / "python3"))
        if self.as_user("test", "-x", str(real)).returncode == 0:
            return
        version = f"python{sys.version_info.major}.{sys.version_info.minor}"
        system = Path("/usr/bin") / version
        assert system.exists(), f"{real} is not reachable by {USER}, and there is no {system} to run the venv with"
        cfg = self.root / "venv" / "pyvenv.cfg"
        lines = cfg.read_text().splitlines()
        cfg.unlink()
        cfg.write_text("\n".join(f"home = {system.parent}" if x.startswith("home =") else
                                 f"executable = {system}" if x.startswith("executable =") else x for x in lines) + "\n")
        cfg.chmod(0o644)
        link = self.root / "venv" / "bin" / "python3"
        link.unlink()
        link.symlink_to(system)

    def as_user(self, *cmd: str) -> subprocess.CompletedProcess:
        return subprocess.run(["runuser", "-u", USER, "--", *cmd], capture_output=True, text=True, env=self.env, timeout=60)

    def start(self):
        host = socket.gethostname().split(".")[0]
        key = self.root / "munge" / "key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        sock = self.root / "run" / "munge.sock"
        self.conf.write_text(f"""ClusterName=motleytest
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={sock},cred_expire={CRED_EXPIRE_S}
SlurmctldPort={free_port()}
StateSaveLocation={self.root / 'state'}
SlurmdSpoolDir={self.root / 'spool'}/%n
SlurmctldPidFile={self.root / 'run' / 'slurmctld.pid'}
SlurmdPidFile={self.root / 'run' / 'slurmd-%n.pid'}
SlurmctldLogFile={self.root / 'log' / 'slurmctld.log'}
SlurmdLogFile={self.root / 'log' / 'slurmd-%n.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
JobRequeue=1
RequeueExit=75
KillWait=5
# Heterogeneous jobs are scheduled by the backfill scheduler only: look every second.
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
NodeName=a0 NodeHostname={host} NodeAddr=127.0.0.1 Port={free_port()} CPUs={os.cpu_count()} State=UNKNOWN
NodeName=b0 NodeHostname={host} NodeAddr=127.0.0.1 Port={free_port()} CPUs={os.cpu_count()} State=UNKNOWN
PartitionName=pa Nodes=a0 Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
PartitionName=pb Nodes=b0 MaxTime=INFINITE State=UP OverSubscribe=YES
""")
        self.spawn([sbin("munged"), "-F", "--force", "-S", str(sock), f"--key-file={key}",
                    f"--log-file={self.root / 'log' / 'munged.log'}", f"--pid-file={self.root / 'munge' / 'pid'}",
                    f"--seed-file={self.root / 'munge' / 'seed'}"])
        self.wait(lambda: sock.exists(), 10, "munged's socket")
        self.spawn([sbin("slurmctld"), "-D", "-f", str(self.conf)])
        for node in NODES:
            self.spawn([sbin("slurmd"), "-D", "-f", str(self.conf), "-N", node], f"slurmd-{node}")
        self.wait(lambda: self.run("sinfo", "-h", "-N", "-o", "%T").stdout.split() == ["idle"] * len(NODES), 60, "both nodes idle in sinfo")

    def spawn(self, cmd, name: str = ""):
        log = open(self.root / "log" / f"{name or Path(cmd[0]).name}.out", "w")
        self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True))

    def run(self, *cmd: str, check: bool = False) -> subprocess.CompletedProcess:
        return subprocess.run([sbin(cmd[0]), *cmd[1:]], capture_output=True, text=True, env=self.env, timeout=60, check=check)

    def wait(self, what, timeout: float, name: str, every: float = 0.25):
        end = time.time() + timeout
        while time.time() < end:
            v = what()
            if v:
                return v
            time.sleep(every)
        raise AssertionError(f"timed out after {timeout} s waiting for {name}\n{self.logs()}")

    def workdir(self, name: str) -> Path:
        """A directory of the unprivileged user's: its job file, state and Slurm output."""
        d = self.root / name
        d.mkdir()
        os.chown(d, pwd.getpwnam(USER).pw_uid, pwd.getpwnam(USER).pw_gid)
        return d

    def job_file(self, work: Path, steps: int, every: int, **fields) -> Path:
        """The tests' job file (`fields` replace its own)."""
        job = {
            "name": "slurm-tiny",
            "model": yaml.safe_load(MODEL.read_text()),
            "global_batch": GLOBAL_BATCH,
            "plan_options": {"host_layer_ms": 0},
            "run": f"{self.root / 'venv' / 'bin' / 'python'} -m motley_torch.train --steps {steps} --seed {SEED}",
            "envs": {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(self.root / "python")},
            # No cloud: the script gives the coordinator one on the state directory.
            "checkpoint": {"every": every, "keep": 2},
            "max_preemptions": 2,
            **fields,
        }
        f = work / "job.yaml"
        f.write_text(yaml.safe_dump(job))
        return f

    def sbatch(self, work: Path, job_file: Path, options: tuple = (), inventory: Path = None) -> int:
        """Submit the shipped script as the user (`options`: sbatch's, e.g. a heterogeneous job's
        components); every agent registers `inventory` (a node entry, or a directory of them),
        by default one P100."""
        if inventory is None:
            inventory = work / "node.yaml"
            inventory.write_text(yaml.safe_dump(node_entry("P100")))
        full = dict(self.env, PATH=f"{self.root / 'bin'}:/usr/sbin:/usr/bin:/bin", MOTLEY_INVENTORY=str(inventory),
                    MOTLEY_HEARTBEAT_MS="250", MOTLEY_SAVE_DEADLINE_S="60", RUST_LOG="info")
        out = subprocess.run(["runuser", "-u", USER, "--", sbin("sbatch"), "--parsable", f"--chdir={work}",
                              f"--output={work / 'slurm-%j.out'}", *options, str(self.root / "motley.sbatch"), str(job_file)],
                             capture_output=True, text=True, env=full, timeout=60)
        assert out.returncode == 0, out.stderr
        return int(out.stdout.strip().split(";")[0])

    def job(self, jid: int) -> dict:
        """`scontrol show job` as a dict (JobState, ExitCode, Restarts, ...)."""
        out = self.run("scontrol", "show", "job", "-o", str(jid)).stdout
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def logs(self) -> str:
        out = []
        for f in sorted(self.root.rglob("*")):
            if f.is_file() and (f.suffix in (".log", ".out") or f.name.startswith("slurm-")) and "python" not in f.parts:
                out.append(f"--- {f}\n{f.read_text(errors='replace')[-3000:]}")
        return "\n".join(out)

    def close(self):
        self.run("scancel", "--full", "--user", USER)
        time.sleep(1)
        for p in reversed(self.procs):
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        # Whatever a job left running as the user (an agent, a rank) from this directory.
        uid = pwd.getpwnam(USER).pw_uid
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                if os.stat(f"/proc/{pid}").st_uid == uid and str(self.root).encode() in Path(f"/proc/{pid}/cmdline").read_bytes() + \
                        Path(f"/proc/{pid}/environ").read_bytes():
                    os.kill(int(pid), signal.SIGKILL)
            except OSError:
                pass
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="module")
def slurm():
    need_slurm()
    s = Slurm()
    try:
        yield s
    finally:
        s.close()


def node_entry(gpu: str) -> dict:
    return {"gpu": gpu, "gpus": 1, "nics": [{"name": "eth0", "kind": "ethernet", "gbps": 25}]}


def state_of(work: Path, jid: int) -> Path:
    return work / "motley-state" / f"slurm-{jid}"


def rank0_losses(work: Path, jid: int, generation: int) -> list:
    """(step, loss) lines rank 0 of the Motley job's launch `generation` printed (job 1: each Slurm
    job's coordinator numbers its own)."""
    return launch_losses(state_of(work, jid), 1, generation)


def finished(slurm: Slurm, jid: int, timeout: float) -> dict:
    return slurm.wait(lambda: (lambda j: j if j.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") else None)(slurm.job(jid)),
                      timeout, f"Slurm job {jid} to end", every=0.5)


def test_a_job_runs_to_its_end_inside_the_allocation_without_root(slurm: Slurm):
    work = slurm.workdir("whole")
    steps = 12
    jid = slurm.sbatch(work, slurm.job_file(work, steps, every=1000))
    j = finished(slurm, jid, 240)
    output = (work / f"slurm-{jid}.out").read_text()
    assert (j["JobState"], j["ExitCode"]) == ("COMPLETED", "0:0"), f"{j}\n{output}\n{slurm.logs()}"
    assert "job 1 succeeded" in output and "job 1 submitted" in output, output
    # Rank 0's output reached the Slurm output file, as `motley dev up` prints it.
    assert '"step": 11' in output, output
    agents = (state_of(work, jid) / "agents.log").read_text()
    assert f"running as uid {pwd.getpwnam(USER).pw_uid}, not root" in agents, agents[-2000:]
    got = rank0_losses(work, jid, 1)
    spec = yaml.safe_load(MODEL.read_text())
    reference = reference_losses(str(MODEL), GLOBAL_BATCH, spec["seq_len"], steps, SEED)
    assert [s for s, _ in got] == list(range(steps)), got
    assert_steps_close([x for _, x in got], reference, layers_of(MODEL), "the allocation's losses against the single process's")
    # The state the coordinator keeps (its database, tokens) is the user's alone.
    coordinator = state_of(work, jid) / "coordinator"
    assert coordinator.stat().st_uid == pwd.getpwnam(USER).pw_uid and (coordinator / "token").stat().st_mode & 0o077 == 0


def test_slurms_warning_signal_saves_exits_75_and_the_requeued_job_resumes_from_that_step(slurm: Slurm):
    work = slurm.workdir("preempted")
    steps = 400
    # No periodic step: what the requeued run resumes from is the save the signal caused.
    jid = slurm.sbatch(work, slurm.job_file(work, steps, every=100_000))
    slurm.wait(lambda: len(rank0_losses(work, jid, 1)) >= 5, 180, "five steps of the first run")
    slurm.run("scancel", "--signal=USR1", "--batch", str(jid), check=True)
    # Slurm requeues a batch job that exits 75 (RequeueExit): Restarts goes to 1.
    slurm.wait(lambda: slurm.job(jid).get("Restarts") == "1", 120, "the job requeued", every=0.5)
    first = (work / f"slurm-{jid}.out").read_text()
    assert "preempted (USR1)" in first and "saved, whole in its checkpoint cloud" in first, first
    assert "resumable: requeue this Slurm job (exit 75)" in first, first
    # The watch, stopped by the script's SIGTERM, said so (its own exit 75).
    assert "the watch was stopped by a signal (preempted)" in first, first
    # The job named no cloud: the coordinator's, on the state directory, took the step.
    cloud = state_of(work, jid) / "cloud"
    assert list(cloud.glob("*/jobs/1/1/step-*/layer.*.safetensors")), f"no step in {cloud}: {sorted(cloud.rglob('*'))[:20]}"
    # Eligible again after cred_expire (not sooner: a requeued job started before its old
    # credential expires is killed, "Job credential revoked").
    j = finished(slurm, jid, 300)
    output = (work / f"slurm-{jid}.out").read_text()
    assert (j["JobState"], j["ExitCode"], j["Restarts"]) == ("COMPLETED", "0:0", "1"), f"{j}\n{output}\n{slurm.logs()}"
    assert "resumes (submitted by an earlier run of this Slurm job)" in output, output
    before = rank0_losses(work, jid, 1)
    after = rank0_losses(work, jid, 2)
    assert after, f"no second launch\n{output}"
    saved = after[0][0]
    assert 5 <= saved <= before[-1][0] + 1, (saved, before[-3:])
    assert after[-1][0] == steps - 1, after[-3:]
    # At most the steps since the signal were run twice: the resume starts at the saved step.
    spec = yaml.safe_load(MODEL.read_text())
    reference = reference_losses(str(MODEL), GLOBAL_BATCH, spec["seq_len"], steps, SEED)
    assert_steps_close([x for _, x in after], [reference[s] for s, _ in after], layers_of(MODEL),
                       "losses after the requeue against the uninterrupted run's", steps=[s for s, _ in after])


def test_a_job_no_notice_can_move_is_not_requeued_on_the_signal(slurm: Slurm):
    """max_preemptions: 0: a drain with a deadline does not save the job, so a requeued run could
    not resume it: the script exits 1 (not 75) and Slurm does not requeue it."""
    work = slurm.workdir("unmovable")
    jid = slurm.sbatch(work, slurm.job_file(work, 4000, every=100_000, max_preemptions=0))
    slurm.wait(lambda: len(rank0_losses(work, jid, 1)) >= 5, 180, "five steps")
    slurm.run("scancel", "--signal=USR1", "--batch", str(jid), check=True)
    j = finished(slurm, jid, 120)
    output = (work / f"slurm-{jid}.out").read_text()
    assert (j["JobState"], j["ExitCode"], j.get("Restarts")) == ("FAILED", "1:0", "0"), f"{j}\n{output}\n{slurm.logs()}"
    assert "preempted (USR1)" in output and "(exit 75)" not in output, output


def test_a_bad_job_file_fails_the_batch_job_with_exit_2_and_says_why(slurm: Slurm):
    work = slurm.workdir("bad")
    jid = slurm.sbatch(work, slurm.job_file(work, 4, every=1000, global_batch=0))
    j = finished(slurm, jid, 120)
    output = (work / f"slurm-{jid}.out").read_text()
    assert (j["JobState"], j["ExitCode"], j.get("Restarts")) == ("FAILED", "2:0", "0"), f"{j}\n{output}"
    assert "global_batch" in output, output


def test_a_heterogeneous_job_runs_one_plan_across_its_components(slurm: Slurm):
    """`sbatch -p pa -N1 : -p pb -N1`: a P100 node from one partition and a T4 node from the
    other in one allocation. The script starts each component's agent in a step of that
    component, and the planner's one plan spans both (a pipeline: the P100 takes the first
    layers, the T4 the rest); its losses are the single process's."""
    work = slurm.workdir("het")
    inventories = work / "nodes"
    inventories.mkdir()
    for node, gpu in zip(NODES, ("P100", "T4")):
        (inventories / f"{node}.yaml").write_text(yaml.safe_dump(node_entry(gpu)))
    for p in (inventories, *inventories.iterdir()):
        os.chown(p, pwd.getpwnam(USER).pw_uid, pwd.getpwnam(USER).pw_gid)
    steps = 12
    jid = slurm.sbatch(work, slurm.job_file(work, steps, every=1000), ("-p", "pa", "-N1", ":", "-p", "pb", "-N1"), inventories)
    j = finished(slurm, jid, 240)
    output = (work / f"slurm-{jid}.out").read_text()
    assert (j["JobState"], j["ExitCode"]) == ("COMPLETED", "0:0"), f"{j}\n{output}\n{slurm.logs()}"
    assert "on a0 b0;" in output and "2 agents live" in output, output
    ran = {p.parts[-5] for p in (state_of(work, jid) / "agents").glob("*/jobs/1/1/rank-*.log")}
    assert ran == set(NODES), f"the plan's ranks ran on {ran}\n{output}"
    got = rank0_losses(work, jid, 1)
    spec = yaml.safe_load(MODEL.read_text())
    reference = reference_losses(str(MODEL), GLOBAL_BATCH, spec["seq_len"], steps, SEED)
    assert [s for s, _ in got] == list(range(steps)), got
    assert_steps_close([x for _, x in got], reference, layers_of(MODEL), "the heterogeneous allocation's losses against the single process's")
