"""This process's resident memory, from /proc (Linux): current, peak, and a peak reset.

`reset_peak()` writes 5 to /proc/self/clear_refs, which sets the peak (VmHWM) to the
current RSS, so `peak_bytes()` after a phase is that phase's peak, not the imports'.
"""

from __future__ import annotations


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} (not Linux?)")


def rss_bytes() -> int:
    return _status_kib("VmRSS") * 1024


def peak_bytes() -> int:
    return _status_kib("VmHWM") * 1024


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
