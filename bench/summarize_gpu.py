"""bench/gpu_check.sh's folder as one markdown page, with issue 4's bars checked:

* reduce kernels at >= 256 MiB reach >= 90% of the device-to-device copy bandwidth measured
  in the same run (bytes read plus written; `pycoll bench kernels`), and the fused pair
  reduction (dst = a op b, the same work as `cupy.add(a, b, out=c)`) is at least as fast as
  CuPy's add;
* every multi-rank collective over CUDA IPC has #wrong = 0 (not shown while a run did not
  finish: its exit status is read from collectives.txt);

plus the ring AllReduce with and without forwarding (PYCOLL_FORWARD=0), AllReduce at 4 ranks
with and without MPS,
and which kernel backend was faster (what `kernels/device.py`'s DEFAULT_BACKEND should be).

    python bench/summarize_gpu.py OUT_FOLDER > bench/results/gpu-h200.md
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

BAR_BYTES = 256 << 20
BAR_OF_COPY = 0.90
REDUCE_KERNELS = ("reduce", "reduce_pair", "reduce_n", "reduce_copy")
UNFORWARDED = "unforwarded-"  # gpu_check.sh's run with PYCOLL_FORWARD=0
STAGED = "staged-"  # its run through the host, made only where an IPC run failed
MPS = "mps-"  # its AllReduce at 4 ranks under MPS, where the machine has MPS
# A run's JSON name prefix -> (what collectives.txt adds after "on N ranks", the table's
# label, whether its #wrong counts toward the IPC bar, whether the bar needs it to finish)
VARIANTS = {
    "": ("", "", True, True),
    UNFORWARDED: (", ring, PYCOLL_FORWARD=0", " (PYCOLL_FORWARD=0)", True, True),
    STAGED: (", PYCOLL_DEVICE_TRANSPORT=staged", " (staged through the host, no IPC)", False,
             False),
    MPS: (", under MPS", " (under MPS)", True, False),  # only where the machine has MPS
}


def human(size: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:g} {unit}"
    return f"{size} B"


def _read(path: Path) -> str | None:
    return path.read_text(errors="replace") if path.exists() else None


def _verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def kernel_section(rows: list[dict]) -> list[str]:
    """The kernels' table and bars; ``rows``: kernels.json's records."""
    lines = ["## Kernels (`pycoll bench kernels`)", ""]
    measured = [r for r in rows if r.get("error") is None]
    failed = [r for r in rows if r.get("error") is not None]
    lines += ["| size | dtype | kernel | backend | GB/s (r+w) | of copy | vs cupy add |",
              "|---|---|---|---|---|---|---|"]
    for r in measured:
        of_copy = f"{100 * r['of_copy']:.1f}%" if r["of_copy"] is not None else "-"
        vs_add = f"{r['vs_cupy_add']:.2f}" if r["vs_cupy_add"] is not None else "-"
        lines.append(f"| {human(r['size'])} | {r['dtype']} | {r['kernel']} | {r['backend']} | "
                     f"{r['bandwidth']:.1f} | {of_copy} | {vs_add} |")
    for r in failed:
        first = r["error"].strip().splitlines()[0] if r["error"].strip() else "?"
        lines.append(f"| {human(r['size'])} | {r['dtype']} | {r['kernel']} | {r['backend']} | "
                     f"failed: {first} | | |")
    lines.append("")
    large = [r for r in measured if r["size"] >= BAR_BYTES and r["kernel"] in REDUCE_KERNELS]
    backends = sorted({r["backend"] for r in large})
    if not large:
        return [*lines, f"No reduce kernel was measured at >= {human(BAR_BYTES)}: the bars "
                        "are not checked.", ""]
    lines += [f"Bars at >= {human(BAR_BYTES)}, per backend (worst case over kernels, sizes "
              "and dtypes):", "",
              "| backend | least of copy | reduce kernels >= 90% of copy | reduce_pair vs cupy "
              "add (least) | as fast as cupy add |", "|---|---|---|---|---|"]
    medians = {}
    for backend in backends:
        mine = [r for r in large if r["backend"] == backend]
        least = min(r["of_copy"] for r in mine)
        medians[backend] = statistics.median(r["of_copy"] for r in mine)
        pairs = [r["vs_cupy_add"] for r in mine
                 if r["kernel"] == "reduce_pair" and r["vs_cupy_add"] is not None]
        vs = f"{min(pairs):.2f}" if pairs else "- (no cupy add)"
        lines.append(f"| {backend} | {100 * least:.1f}% | {_verdict(least >= BAR_OF_COPY)} | "
                     f"{vs} | {_verdict(min(pairs) >= 1.0) if pairs else '-'} |")
    best = max(medians, key=medians.get)
    lines += ["", f"Faster backend (median fraction of copy at >= {human(BAR_BYTES)}): "
                  f"**{best}** ({', '.join(f'{b} {100 * m:.1f}%' for b, m in medians.items())})"
                  " -> kernels/device.py DEFAULT_BACKEND.", ""]
    return lines


def run_exits(folder: Path) -> dict[str, int]:
    """Each collective run's exit status, from collectives.txt's closing lines, by the name
    of its JSON file without '.json' (124: stopped by gpu_check.sh's time limit; 125:
    skipped, after an IPC run timed out or failed, or with no time left)."""
    prefix_of = {said: prefix for prefix, (said, *_) in VARIANTS.items()}
    exits = {}
    for line in (_read(folder / "collectives.txt") or "").splitlines():
        said = re.fullmatch(r"# (\w+) on (\d+) ranks(, [^:]*)?: exit (\d+)", line.strip())
        if said and (said.group(3) or "") in prefix_of:
            name, ranks, variant, status = said.groups()
            exits[f"{prefix_of[variant or '']}{name}-{ranks}"] = int(status)
    return exits


def _variant(name: str) -> str:
    """The VARIANTS prefix of a run's name."""
    return next((prefix for prefix in VARIANTS if prefix and name.startswith(prefix)), "")


def collective_section(folder: Path) -> list[str]:
    """#wrong and the fastest algorithm per collective, rank count and size; a run that did
    not finish (its rows are those measured before it stopped) keeps the bar from being met."""
    lines = ["## Collectives over CUDA IPC (`pycoll bench --device cuda --check 1`)", ""]
    files = {p.name[: -len(".json")]: p for p in sorted(folder.glob("*-[0-9]*.json"))}
    exits = run_exits(folder)
    if not files and not exits:
        return [*lines, "No collective results.", ""]
    lines += ["| collective | ranks | rows | #wrong | sizes | fastest at the largest size | exit |",
              "|---|---|---|---|---|---|---|"]
    total_wrong, unfinished, unchecked = 0, [], []
    staged = False
    for name in sorted(set(files) | set(exits)):
        rows = json.loads(files[name].read_text()) if name in files else []
        status = exits.get(name)
        variant = _variant(name)
        _, label, in_bar, must_finish = VARIANTS[variant]
        staged = staged or variant == STAGED
        if must_finish and status not in (None, 0, 1):  # 1: ended, some value was wrong
            unfinished.append(name)
        said = "-" if status is None else str(status)
        if not rows:
            collective, ranks = name.removeprefix(variant).rsplit("-", 1)
            lines.append(f"| {collective}{label} | {ranks} | 0 | - | - | - | {said} |")
            continue
        checked = [r for r in rows if r["wrong"] is not None]  # None: run with --check 0
        wrong = sum(r["wrong"] + (r.get("in_place_wrong") or 0) for r in checked)
        total_wrong += wrong if in_bar else 0
        if must_finish and len(checked) < len(rows):
            unchecked.append(name)
        largest = max(r["size"] for r in rows)
        at_largest = [r for r in rows if r["size"] == largest and r["algorithm"] != "auto"]
        fastest = min(at_largest, key=lambda r: r["time_us"]) if at_largest else None
        best = (f"{fastest['algorithm']} ({fastest['busbw']:.1f} GB/s busbw)"
                if fastest else "-")
        sizes = f"{human(min(r['size'] for r in rows))} .. {human(largest)}"
        missing = len(rows) - len(checked)
        not_checked = f" ({missing} not checked)" if missing else ""
        lines.append(f"| {rows[0]['collective']}{label} | {rows[0]['nranks']} | {len(rows)} | "
                     f"{wrong}{not_checked} | {sizes} | {best} | {said} |")
    if total_wrong == 0 and unfinished:
        said = ", ".join(f"{name}: exit {exits[name]}" for name in unfinished)
        verdict = (f"not shown: {len(unfinished)} run(s) did not finish ({said}; exit 124 is "
                   "gpu_check.sh's time limit, 125 skipped after an IPC run timed out or "
                   "failed or with no time left, 2 a refusal such as no GPU)")
    elif total_wrong == 0 and unchecked:
        verdict = f"not shown: rows run without --check in {', '.join(unchecked)}"
    else:
        verdict = _verdict(total_wrong == 0)
    lines += ["", f"Bar, every multi-rank IPC collective #wrong = 0: {verdict}"
                  f" ({total_wrong} wrong values in all).", ""]
    if staged:
        lines += ["An IPC run failed, so gpu_check.sh ran AllReduce staged through the host "
                  "(PYCOLL_DEVICE_TRANSPORT=staged, no peer access) as well: not part of the "
                  "bar; it tells a machine that refuses CUDA IPC from a wrong schedule (see "
                  "collectives.txt for the IPC runs' errors).", ""]
    return lines


def forward_section(folder: Path) -> list[str]:
    """The ring AllReduce forwarding (each chunk reduced or copied into place and into the
    next rank's inbox in one pass) against the same ring reducing or copying, then sending
    (PYCOLL_FORWARD=0), per size."""
    lines = ["## The ring's forwarding (`PYCOLL_FORWARD=0` for without)", ""]
    paths = [folder / "allreduce-4.json", folder / f"{UNFORWARDED}allreduce-4.json"]
    if not all(p.exists() for p in paths):
        return [*lines, "Not measured (no allreduce-4.json and "
                        f"{UNFORWARDED}allreduce-4.json).", ""]
    with_it, without = ({r["size"]: r for r in json.loads(p.read_text())
                         if r["algorithm"] == "ring"} for p in paths)
    sizes = sorted(set(with_it) & set(without))
    if not sizes:
        return [*lines, "No size measured both ways.", ""]
    lines += ["| size | busbw, forwarding (GB/s) | busbw, reduce then send (GB/s) | "
              "time without / with |", "|---|---|---|---|"]
    for size in sizes:
        a, b = with_it[size], without[size]
        lines.append(f"| {human(size)} | {a['busbw']:.1f} | {b['busbw']:.1f} | "
                     f"{b['time_us'] / a['time_us']:.2f} |")
    return [*lines, "", "Two runs of `pycoll bench allreduce --algorithm ring` at 4 ranks, one "
                        "after the other on the same GPU.", ""]


def mps_section(folder: Path) -> list[str]:
    """AllReduce at 4 ranks sharing the GPU, taking turns (no MPS) against under MPS, per
    algorithm at the smallest and the largest size measured both ways."""
    lines = ["## Ranks sharing the GPU: taking turns, and under MPS", ""]
    paths = [folder / "allreduce-4.json", folder / f"{MPS}allreduce-4.json"]
    status = run_exits(folder).get(f"{MPS}allreduce-4")
    if status not in (None, 0, 1):
        return [*lines, f"The run under MPS did not finish (exit {status}; its rows are in the "
                        "table above): collectives.txt has its errors and MPS's logs.", ""]
    if not all(p.exists() for p in paths):
        return [*lines, "Not measured (no allreduce-4.json and "
                        f"{MPS}allreduce-4.json: no MPS on the machine, or no time left).", ""]
    turns, mps = ({(r["algorithm"], r["size"]): r for r in json.loads(p.read_text())}
                  for p in paths)
    both = sorted(set(turns) & set(mps), key=lambda k: (k[1], k[0]))
    if not both:
        return [*lines, "No algorithm and size measured both ways.", ""]
    ends = {min(size for _, size in both), max(size for _, size in both)}
    lines += ["| algorithm | size | time, taking turns (us) | time under MPS (us) | "
              "turns / MPS | #wrong under MPS |", "|---|---|---|---|---|---|"]
    for key in both:
        if key[1] in ends:
            a, b = turns[key], mps[key]
            lines.append(f"| {key[0]} | {human(key[1])} | {a['time_us']:.1f} | "
                         f"{b['time_us']:.1f} | {a['time_us'] / b['time_us']:.2f} | "
                         f"{'-' if b['wrong'] is None else b['wrong']} |")
    return [*lines, "", "Two runs of `pycoll bench allreduce --algorithm all` at 4 ranks on "
                        "one GPU in the same gpu_check.sh run: step 1 without MPS, step 5 "
                        "under nvidia-cuda-mps-control -d.", ""]


def _test_results(tests: str | None) -> list[str]:
    """Each pytest run's count line ("N passed, ... in Ts"; its last line where the run was
    cut before it), then gpu_check.sh's exit line for that run."""
    if tests is None:
        return ["(no gpu-tests.txt)"]
    said: list[str] = []
    counts = last = note = None
    for line in filter(str.strip, tests.splitlines()):
        if re.fullmatch(r"# \S+: exit \d+", line.strip()):
            said += [counts or last or "(no output)", *([note] if note else []), line]
            counts = last = note = None
        elif line.startswith("# tests skipped for want of a GPU"):  # gpu_check.sh's verdict
            note = line
        else:
            last = line
            if re.search(r"\b\d+ (passed|failed|errors?|skipped)\b", line):
                counts = line
    if last is not None:  # a run with no exit line yet
        said.append(counts or last)
    return said or ["(gpu-tests.txt is empty)"]


def main(folder: str) -> str:
    root = Path(folder)
    environment = _read(root / "environment.txt") or "(no environment.txt)\n"
    env_lines = environment.splitlines()
    header = next((i for i, line in enumerate(env_lines) if line.startswith("name,")), None)
    # nvidia-smi's CSV: a header, then the device's row
    device = (env_lines[header + 1].split(",")[0]
              if header is not None and header + 1 < len(env_lines) else "an unknown device")
    lines = [f"# GPU check on {device}", "",
             "Written by `python bench/summarize_gpu.py` from `bash bench/gpu_check.sh`'s "
             "folder.", ""]
    summary = _read(root / "summary.txt")
    lines += ["## Steps", "", "```", (summary or "(no summary.txt: the script did not finish)")
              .strip(), "```", ""]
    lines += ["## GPU tests", "", "```", *_test_results(_read(root / "gpu-tests.txt")), "```",
              ""]
    kernels = root / "kernels.json"
    lines += (kernel_section(json.loads(kernels.read_text())) if kernels.exists()
              else ["## Kernels", "", "No kernels.json.", ""])
    lines += collective_section(root)
    lines += forward_section(root)
    lines += mps_section(root)
    lines += ["## Environment", "", "```", environment.strip(), "```", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python bench/summarize_gpu.py OUT_FOLDER")
    print(main(sys.argv[1]))
