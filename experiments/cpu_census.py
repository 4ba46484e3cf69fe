"""CPU seconds each process on this machine spends over an idle wait or over a command,
largest first: where the cores go while a server idles or serves.

    python experiments/cpu_census.py --seconds 30                        # the server idle
    python experiments/cpu_census.py -- specserve bench ... --modes served-ar ...

A process that exits before the end (the command itself) is not counted.
"""

from __future__ import annotations

import argparse
import subprocess
import time

import psutil


def cpu_by_process() -> dict[int, tuple[str, float]]:
    seen = {}
    for proc in psutil.process_iter(["name", "cmdline"]):
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        seen[proc.pid] = (" ".join(proc.info["cmdline"] or [proc.info["name"]])[:80], times.user + times.system)
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="how long to wait when no command is given")
    parser.add_argument("--min", type=float, default=0.05, help="leave out processes under this many CPU seconds")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND...: count while it runs")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    before, start = cpu_by_process(), time.monotonic()
    if command:
        subprocess.run(command, check=False)
    else:
        time.sleep(args.seconds)
    after, wall = cpu_by_process(), time.monotonic() - start
    spent = sorted(((seconds - before.get(pid, ("", 0.0))[1], name) for pid, (name, seconds) in after.items()),
                   reverse=True)
    total = sum(seconds for seconds, _ in spent)
    print(f"{wall:.1f} s wall; CPU seconds by process:")
    for seconds, name in spent:
        if seconds >= args.min:
            print(f"{seconds:8.2f}  {name}")
    print(f"{total:8.2f}  in all ({total / wall:.2f} cores)")


if __name__ == "__main__":
    main()
