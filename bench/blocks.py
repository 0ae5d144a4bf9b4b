"""Where threads wait: a sampler process that reads what some threads of another process are doing.

``bench_train.py --sample-blocks`` starts one, pointed at the training thread, autograd's device
thread (which runs the backward while the training thread waits for it) and the prefetch
service's thread. The sampler reads ``/proc/PID/task/TID/syscall`` of each in turn, in a loop
(Linux): ``running`` while the thread runs (or is runnable), else the system call it is blocked
in and that call's arguments. For ``futex`` the
first argument is the address waited on, which names the lock or condition: the GIL, a mutex of
the CUDA driver, of torch's allocator, a condition of a queue. The sampler is a process of its own
so that it takes no GIL of the process it watches; it costs one CPU while it samples.

Samples are counted per label: the watching process writes a label (one line on the sampler's
stdin) when an epoch of a method starts and ``-`` when it ends; between the two, every sample
counts for that label. A label line may start with ``@T `` (``BlockSampler.label`` writes it),
the writer's ``time.monotonic()`` (``CLOCK_MONOTONIC``, one clock for the processes of a
machine): a label's seconds are then the writer's, whenever the sampler gets to read the line;
without it, the time the sampler reads it. A line ``+NAME TID`` watches one more thread under
NAME (or another thread under a NAME already watched) and leaves the label and its time as they
are. Closing stdin ends the sampler, which then prints one JSON object: for each label its
seconds and its counts by thread and key (``NAME running``, ``NAME fault`` for a
thread blocked outside a system call, ``NAME gone`` for one that has ended, a system call's name,
or ``NAME futex <address>``), and for each futex address the mapping it lies in
(``/proc/PID/maps``: the binary or library whose data holds it, ``[heap]`` or an anonymous
mapping) and its offset there.

Run directly (``python3 bench/blocks.py PID NAME=TID ...``) it samples until its stdin closes.
"""
from __future__ import annotations

import bisect
import json
import os
import select
import subprocess
import sys
import time
from typing import Any, Optional

# x86_64 and aarch64 system call numbers of the calls a waiting thread is seen in
SYSCALLS = {
    "x86_64": {0: "read", 1: "write", 7: "poll", 16: "ioctl", 23: "select", 24: "sched_yield", 35: "nanosleep",
               45: "recvfrom", 47: "recvmsg", 61: "wait4", 202: "futex", 230: "clock_nanosleep", 232: "epoll_wait",
               270: "pselect6", 271: "ppoll", 281: "epoll_pwait", 17: "pread64", 19: "readv", 9: "mmap",
               11: "munmap", 10: "mprotect", 12: "brk", 28: "madvise", 96: "gettimeofday", 228: "clock_gettime"},
    "aarch64": {63: "read", 64: "write", 29: "ioctl", 124: "sched_yield", 101: "nanosleep", 98: "futex",
                115: "clock_nanosleep", 22: "epoll_pwait", 73: "ppoll", 72: "pselect6", 207: "recvfrom",
                212: "recvmsg", 222: "mmap", 215: "munmap", 226: "mprotect", 233: "madvise"},
}
FUTEX = {"x86_64": 202, "aarch64": 98}


def classify(line: bytes, names: dict[int, str], futex_nr: int) -> str:
    """The key of one reading of ``/proc/PID/task/TID/syscall``."""
    if line.startswith(b"running"):
        return "running"
    parts = line.split()
    if not parts:
        return "gone"
    nr = int(parts[0])
    if nr == -1:  # blocked, not in a system call (a page fault, a stop)
        return "fault"
    if nr == futex_nr and len(parts) > 1:
        return f"futex {parts[1].decode()}"
    return names.get(nr, f"syscall {nr}")


def parse_maps(text: str) -> list[tuple[int, int, int, str]]:
    """(start, end, file offset, name) of each mapping of a ``/proc/PID/maps`` text."""
    out = []
    for row in text.splitlines():
        f = row.split(None, 5)
        if len(f) < 5:
            continue
        lo, _, hi = f[0].partition("-")
        name = f[5].strip() if len(f) > 5 else "[anon]"
        out.append((int(lo, 16), int(hi, 16), int(f[2], 16), name))
    return out


def locate(addr: int, maps: list[tuple[int, int, int, str]], starts: Optional[list[int]] = None) -> str:
    """Where an address lies: ``libname+0xoffset`` (offset from the file's start, for a file's
    data), ``[heap]+0x...``, ``[anon]``, or ``?``. ``maps`` in address order (as /proc lists
    them); ``starts``: their start addresses, where the caller locates many addresses."""
    if starts is None:
        starts = [m[0] for m in maps]
    i = bisect.bisect_right(starts, addr) - 1
    if i >= 0:
        lo, hi, off, name = maps[i]
        if lo <= addr < hi:
            if name.startswith("/"):
                base = lo - off  # the file's first byte, where its mappings are contiguous
                return f"{os.path.basename(name)}+{addr - base:#x}"
            if name == "[anon]" and i > 0 and maps[i - 1][3].startswith("/") and maps[i - 1][1] == lo:
                prev = maps[i - 1]  # the .bss just after a library's data
                return f"{os.path.basename(prev[3])} bss+{addr - lo:#x}"
            return f"{name}+{addr - lo:#x}" if name == "[heap]" else name
    return "?"


def _open(pid: int, tid: int) -> int:
    try:
        return os.open(f"/proc/{pid}/task/{tid}/syscall", os.O_RDONLY)
    except OSError:  # the thread has ended: every sample reads "gone"
        return -1


def sample(pid: int, threads: dict[str, int], control: int = 0) -> dict[str, Any]:
    """Sample the threads (name: native id) of ``pid`` until ``control`` (a file descriptor of
    control lines, see the module's docstring) ends."""
    arch = os.uname().machine
    names, futex_nr = SYSCALLS.get(arch, {}), FUTEX.get(arch, -1)
    fds = {name: _open(pid, tid) for name, tid in threads.items()}
    os.set_blocking(control, False)
    counts: dict[str, dict[str, int]] = {}
    label: Optional[str] = None
    cur: Optional[dict[str, int]] = None
    pending = b""
    poller = select.poll()
    poller.register(control, select.POLLIN)
    open_ = True
    t_label = 0.0
    seconds: dict[str, float] = {}
    while open_:
        if cur is None:
            poller.poll()  # nothing to count: wait for the next label
        else:
            for _ in range(256):
                for name, fd in fds.items():
                    try:
                        line = os.pread(fd, 512, 0) if fd >= 0 else b""
                    except OSError:  # the thread ended
                        line = b""
                    key = f"{name} {classify(line, names, futex_nr)}"
                    cur[key] = cur.get(key, 0) + 1
        try:
            chunk = os.read(control, 4096)
        except BlockingIOError:
            continue
        if not chunk:
            open_ = False
        pending += chunk
        while b"\n" in pending:
            row, pending = pending.split(b"\n", 1)
            text = row.decode().strip()
            if text.startswith("+"):
                name, tid = text[1:].split()
                if fds.get(name, -1) >= 0:
                    os.close(fds[name])
                fds[name] = _open(pid, int(tid))
                continue
            now = time.monotonic()
            if text.startswith("@"):  # the writer's time of the label
                stamp, _, text = text[1:].partition(" ")
                now = float(stamp)
            if label is not None:
                seconds[label] = seconds.get(label, 0.0) + now - t_label
            label = None if text in ("", "-") else text
            cur = None if label is None else counts.setdefault(label, {})
            t_label = now
    try:
        with open(f"/proc/{pid}/maps") as f:
            maps = parse_maps(f.read())
    except OSError:
        maps = []
    where = {}
    starts = [m[0] for m in maps]
    for c in counts.values():
        for key in c:
            parts = key.split()
            if len(parts) == 3 and parts[1] == "futex":
                if f"futex {parts[2]}" not in where:
                    where[f"futex {parts[2]}"] = locate(int(parts[2], 16), maps, starts)
    return {"counts": counts, "seconds": seconds, "where": where}


class BlockSampler:
    """The watching side: a sampler process pointed at threads of this process (name: native id)."""

    def __init__(self, threads: dict[str, int]):
        for name in threads:
            if not name or any(c.isspace() or c == "=" for c in name):
                raise ValueError(f"a thread's name is one word without '=', not {name!r}")
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), str(os.getpid())] +
                                     [f"{n}={t}" for n, t in threads.items()],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def watch(self, name: str, tid: int) -> None:
        """Watch thread ``tid`` under ``name`` from now on (in place of the thread so named)."""
        if not name or any(c.isspace() or c == "=" for c in name):
            raise ValueError(f"a thread's name is one word without '=', not {name!r}")
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"+{name} {tid}\n".encode())
        self.proc.stdin.flush()

    def label(self, text: Optional[str]) -> None:
        """Count the following samples for ``text`` (None: stop counting)."""
        if "\n" in (text or ""):
            raise ValueError("a label is one line")
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"@{time.monotonic():.9f} {text or '-'}\n".encode())
        self.proc.stdin.flush()

    def finish(self, timeout: float = 300.0) -> dict[str, Any]:
        """End the sampler; its counts."""
        out, _ = self.proc.communicate(timeout=timeout)
        if self.proc.returncode:
            raise RuntimeError(f"block sampler exited with {self.proc.returncode}")
        return json.loads(out)


def summary(report: dict[str, Any], label: str, thread: str, top: int = 6) -> list[tuple[str, float]]:
    """The ``top`` states of one thread in one label by share of its samples (``running``
    first). Futex addresses are named by where they lie, those of one 64-byte line together (a
    condition variable's words: the GIL is one)."""
    prefix = thread + " "
    c = {k[len(prefix):]: n for k, n in report["counts"].get(label, {}).items() if k.startswith(prefix)}
    total = sum(c.values())
    if not total:
        return []
    lines: dict[int, str] = {}  # a 64-byte line: the name of its lowest address seen
    for w in sorted(report["where"], key=lambda w: int(w.split()[1], 16), reverse=True):
        lines[int(w.split()[1], 16) & ~63] = report["where"][w]
    merged: dict[str, int] = {}
    for k, n in c.items():
        if k.startswith("futex "):
            k = f"futex {lines.get(int(k.split()[1], 16) & ~63, '?')}"
        merged[k] = merged.get(k, 0) + n
    rows = sorted(merged.items(), key=lambda kv: (kv[0] != "running", -kv[1]))[:top]
    return [(k, n / total) for k, n in rows]


if __name__ == "__main__":
    if len(sys.argv) < 3 or not all("=" in a for a in sys.argv[2:]):
        sys.exit("usage: blocks.py PID NAME=TID ... (control lines on stdin; JSON on stdout when it closes)")
    json.dump(sample(int(sys.argv[1]), {a.split("=")[0]: int(a.split("=")[1]) for a in sys.argv[2:]}), sys.stdout)
