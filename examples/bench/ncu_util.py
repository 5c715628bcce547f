"""Nsight Compute helpers shared by the kernel-only timing scripts (ncu_decode.py, ncu_prefill.py, ncu_write_kv.py)."""

import csv
import glob
import io
import subprocess


def ncu_binary():
    found = sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"))
    return found[-1] if found else "ncu"


def ncu_command(kernel_regex, launches, command, flush_caches=True):
    """The ncu command line: clocks left alone; caches flushed before every profiled kernel (ncu's default) or, with
    flush_caches=False, left as the previous kernels left them (`--cache-control none`: what a kernel finds in L2
    in a running program, e.g. the small inputs the step's earlier kernels wrote or read)."""
    return [ncu_binary(), "--csv", "--clock-control", "none", *([] if flush_caches else ["--cache-control", "none"]),
            "-k", f"regex:{kernel_regex}", "-c", str(launches), "--metrics", "gpu__time_duration.sum", *command]


def kernel_durations(kernel_regex, launches, command, flush_caches=True):
    """Runs `command` under ncu (ncu_command) and returns [(kernel name, duration in ns)] of the first `launches`
    kernels matching kernel_regex, in order."""
    cmd = ncu_command(kernel_regex, launches, command, flush_caches)
    text = subprocess.run(cmd, capture_output=True, text=True).stdout
    rows = [r for r in csv.DictReader(io.StringIO(text[text.find('"ID"'):])) if r.get("Metric Name")]
    scale = {"ns": 1.0, "nsecond": 1.0, "us": 1e3, "usecond": 1e3, "ms": 1e6, "msecond": 1e6}
    return [(r["Kernel Name"], float(r["Metric Value"].replace(",", "")) * scale.get(r["Metric Unit"], 1.0))
            for r in rows]
