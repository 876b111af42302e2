"""Rank processes forked from one that has already imported torch and the trainer.

A rank's process spends about 3 s of CPU importing torch and motley_torch before any work of its
own (BENCHMARKS.md, "A rank's fixed CPU"), and the suite starts hundreds of ranks on a machine of
two cores. Here a server, one per test session, imports them once and forks every rank the tests
start from itself: each rank is still a process of its own, with its own environment, arguments,
working directory, session (it leads its process group, as `start_new_session` makes it), open
output files and exit status, and runs `motley_torch.train` as `__main__` (runpy, as `python -m`
does). What differs from `python -m`: the modules the server imported are in `sys.modules`
already, imported under the server's environment (no module of motley_torch reads the
environment when it is imported; the ranks' variables are read when they run). A rank ends the
way the trainer ends one (`rank_exit.end_rank`: streams flushed, no interpreter teardown).

`MOTLEY_TEST_FORK=0` starts every rank with `python -m` instead (launcher.start_ranks).

One connection per rank over a Unix socket: the client sends one JSON line {module, argv, env,
cwd} with the rank's stdout and stderr as file descriptors (SCM_RIGHTS); the server forks and
answers {"pid": P}; when the rank ends it sends {"returncode": R} (Popen's: -N for signal N).
"""

from __future__ import annotations

import json
import os
import select
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import List, Optional

# What a rank imports whichever flags it has (the rest it imports as it needs them). The module
# a rank runs is imported for what it imports, then forgotten: each rank runs it afresh as
# __main__, as `python -m` does.
PRELOAD = ("torch", "torch.distributed", "motley_torch.trainer", "motley_torch.distributed.gradient_sync",
           "motley_torch.distributed.pipeline")
RUN = ("motley_torch.train",)


class ForkedRank:
    """The part of `subprocess.Popen` the tests use of a rank: pid, returncode, poll, wait,
    kill, send_signal."""

    def __init__(self, conn: socket.socket, pid: int, args: List[str]):
        self.conn, self.pid, self.args = conn, pid, args
        self.returncode: Optional[int] = None
        self._buf = b""

    def _read(self, timeout: Optional[float]):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            if b"\n" in self._buf:  # the end came with the pid
                self.returncode = int(json.loads(self._buf.split(b"\n", 1)[0])["returncode"])
                self.conn.close()
                return
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self.conn], [], [], left)
            if not ready:
                return
            data = self.conn.recv(4096)
            if not data:
                raise RuntimeError(f"the rank server went before telling rank process {self.pid}'s end")
            self._buf += data
            if b"\n" in self._buf:
                self.returncode = int(json.loads(self._buf.split(b"\n", 1)[0])["returncode"])
                self.conn.close()

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self._read(0)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None:
            self._read(timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int):
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self):
        self.send_signal(signal.SIGKILL)

    def terminate(self):
        self.send_signal(signal.SIGTERM)


class RankForkServer:
    """The server process (`serve`) and the client's end: `spawn` starts one rank."""

    def __init__(self, python: str, env: dict):
        self.env = dict(env)
        self.dir = tempfile.mkdtemp(prefix="motley-rank-fork.")
        self.path = os.path.join(self.dir, "socket")
        self.proc = subprocess.Popen([python, os.path.abspath(__file__), self.path], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, start_new_session=True)
        line = self.proc.stdout.readline()
        if line.strip() != b"ready":
            raise RuntimeError(f"the rank server did not start (exit {self.proc.wait()})")

    def starts_like(self, env: dict) -> bool:
        """Whether a rank with environment `env` starts its interpreter as the server did (the
        variables read before any code runs, PYTHONPATH, PYTHONHASHSEED..., and the thread
        pools' sizes, which torch may have read when it was imported): where not, the rank must
        be started with `python -m` (a test that shadows a package on PYTHONPATH)."""
        def python(e):
            return {k: v for k, v in e.items() if k.startswith(("PYTHON", "OMP_", "MKL_"))}

        return python(env) == python(self.env)

    def spawn(self, module: str, args: List[str], env: dict, cwd: str, stdout, stderr) -> ForkedRank:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.path)
        req = json.dumps({"module": module, "argv": list(args), "env": env, "cwd": str(cwd)}).encode() + b"\n"
        socket.send_fds(conn, [req], [stdout.fileno(), stderr.fileno()])
        buf = b""
        while b"\n" not in buf:
            data = conn.recv(4096)
            if not data:
                raise RuntimeError("the rank server closed the connection before forking the rank")
            buf += data
        head, rest = buf.split(b"\n", 1)
        rank = ForkedRank(conn, int(json.loads(head)["pid"]), ["-m", module, *args])
        rank._buf = rest
        return rank

    def close(self):
        # The server ends when its stdin does; ranks still running are their tests' to end.
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        os.unlink(self.path) if os.path.exists(self.path) else None
        os.rmdir(self.dir)


def _run_rank(req: dict, fds: List[int]) -> int:
    """In the forked child: become the rank, run its module as __main__, return its code."""
    import runpy
    import traceback

    os.setsid()
    os.chdir(req["cwd"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in (null, *fds):
        os.close(fd)
    os.environ.clear()
    os.environ.update(req["env"])
    sys.argv = ["-m", *req["argv"]]
    sys.path[0] = os.getcwd()  # as `python -m` puts the working directory first
    try:
        runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1


def serve(path: str):
    for name in PRELOAD + RUN:
        __import__(name)
    for name in RUN:
        package, _, leaf = name.rpartition(".")
        del sys.modules[name]
        delattr(sys.modules[package], leaf)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    sel.register(sys.stdin.fileno(), selectors.EVENT_READ)
    ranks = {}  # pid -> the connection its end is told on
    print("ready", flush=True)
    while True:
        for key, _ in sel.select(timeout=1.0):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                req, fds = _receive(conn)
                pid = os.fork()
                if pid == 0:
                    code = 1
                    try:
                        signal.set_wakeup_fd(-1)
                        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                        for s in (listener, conn, *ranks.values()):
                            s.close()
                        for fd in (wake_r, wake_w):
                            os.close(fd)
                        code = _run_rank(req, fds)
                    finally:
                        from motley_torch.components.rank_exit import end_rank

                        end_rank(code)
                for fd in fds:
                    os.close(fd)
                ranks[pid] = conn
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            elif key.fileobj == wake_r:
                os.read(wake_r, 4096)
            elif not os.read(sys.stdin.fileno(), 4096):
                return
        while ranks:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = ranks.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                except OSError:
                    pass  # the test gave the rank up
                conn.close()


def _receive(conn: socket.socket):
    msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
    while not msg.endswith(b"\n"):
        more = conn.recv(1 << 20)
        if not more:
            raise RuntimeError("a rank request cut short")
        msg += more
    return json.loads(msg), fds


if __name__ == "__main__":
    serve(sys.argv[1])
