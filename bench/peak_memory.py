"""Run a command and report the peak total memory (PSS of all processes) of the machine's user space.

    python bench/peak_memory.py -- python -m launch.train --config configs/tiny-cpu.yaml

Samples every 0.5 s the summed proportional set size (PSS, shared pages split between the processes
that map them) of every process except the sampler and its ancestors; prints the peak in GiB. Run it
on an otherwise idle machine: everything else running counts too.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time


def _pss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def total_pss_gib(skip: set[int]) -> float:
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) not in skip]
    return sum(_pss_kib(p) for p in pids) / 2**20


def main() -> int:
    cmd = sys.argv[sys.argv.index("--") + 1 :] if "--" in sys.argv else sys.argv[1:]
    skip = {os.getpid(), os.getppid()}
    baseline = total_pss_gib(skip)
    peak = [baseline]
    proc = subprocess.Popen(cmd)
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], total_pss_gib(skip))
            time.sleep(0.5)

    t = threading.Thread(target=sample, daemon=True)
    t0 = time.perf_counter()
    t.start()
    rc = proc.wait()
    stop.set()
    t.join()
    print(f"peak memory (PSS, all processes): {peak[0]:.2f} GiB (before start {baseline:.2f} GiB); "
          f"wall {time.perf_counter() - t0:.1f}s; exit {rc}")  # fmt: skip
    return rc


if __name__ == "__main__":
    sys.exit(main())
