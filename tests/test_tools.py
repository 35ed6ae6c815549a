"""The calibration and comparison tools: pycoll tune, compare and model, end to end on tiny
sweeps (their real runs are committed under bench/results/ and docs/scaling.md)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from conftest import PYTHON

import pycoll
from pycoll import model, scaling, tune
from pycoll.cli import main
from pycoll.schedule import Collective


def test_tune_measures_fits_and_writes_a_tuning_file(tmp_path, capsys):
    path = tmp_path / "tuning.json"
    assert main(["tune", "--output", str(path), "--repeats", "2", "-e", "256K",
                 "--ranks", "2,3"]) == 0
    out = capsys.readouterr().out
    assert "# local: alpha" in out and "residual" in out and f"# wrote {path}" in out
    tuned = model.load_tuning(path)["local"]
    assert [t.nranks for t in tuned] == [2, 3]
    for topology in tuned:
        assert topology.intra.alpha > 0 and topology.gamma > 0 and topology.delta > 0
        assert dict(topology.curves).keys() >= {"gamma", "delta", "intra"}
    assert set(json.loads(path.read_text())["fits"]) == {"local@2", "local@3"}


def test_a_line_fit_recovers_its_line_and_reports_residuals():
    points = [(b, 5e-6 + b * 1e-10) for b in (8, 1024, 1 << 20)]
    line = tune.fit("exact", points)
    assert line.fixed == pytest.approx(5e-6) and line.per_byte == pytest.approx(1e-10)
    assert line.worst_residual() < 1e-9 and "+0.0%" in line.table()


def test_compare_writes_a_table_and_a_plot(tmp_path, capsys):
    prefix = tmp_path / "cmp"
    assert main(["compare", "allreduce", "--ranks", "3", "-b", "1K", "-e", "64K", "-f", "8",
                 "-n", "3", "-w", "1", "--output", str(prefix)]) == 0
    table = (tmp_path / "cmp.md").read_text()
    assert "| 1 KiB |" in table and "| 64 KiB |" in table and "auto vs fastest" in table
    assert "Made by `pycoll compare allreduce --ranks 3" in table
    assert (tmp_path / "cmp.png").read_bytes()[:4] == b"\x89PNG"
    assert "wrote" in capsys.readouterr().out


def test_compare_without_matplotlib_keeps_its_table(tmp_path, capsys, monkeypatch):
    """matplotlib is an extra: without it the sweep's table is still printed and written
    (it raised ModuleNotFoundError after measuring, and left a link to no plot)."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import raises ImportError
    prefix = tmp_path / "cmp"
    assert main(["compare", "allreduce", "--ranks", "2", "-b", "1K", "-e", "1K", "-n", "1",
                 "-w", "0", "--output", str(prefix)]) == 0
    out = capsys.readouterr().out
    assert "| 1 KiB |" in out and "no plot: matplotlib is not installed" in out
    table = (tmp_path / "cmp.md").read_text()
    assert "| 1 KiB |" in table and ".png" not in table
    assert not (tmp_path / "cmp.png").exists()


def test_compare_checks_both_files_it_writes_before_measuring(tmp_path, capsys, monkeypatch):
    """PREFIX.png too (a folder there failed after measuring, with a traceback); and PREFIX
    itself may be a folder (the files are PREFIX.md and PREFIX.png beside it)."""
    (tmp_path / "cmp.png").mkdir()
    args = ["compare", "allreduce", "--ranks", "2", "-b", "8", "-e", "8", "-n", "1", "-w", "0"]
    assert main([*args, "--output", str(tmp_path / "cmp")]) == 2
    assert f"--output {tmp_path}/cmp.png: cannot write a file there" in capsys.readouterr().err
    assert main([*args, "--output", str(tmp_path)]) == 0
    assert (tmp_path.parent / f"{tmp_path.name}.md").exists()
    monkeypatch.chdir(tmp_path / "cmp.png")  # no --output: the current folder's files
    (tmp_path / "cmp.png" / "compare-allreduce-2.md").mkdir()
    assert main(args) == 2
    assert ("without --output, compare-allreduce-2.md: cannot write a file there"
            in capsys.readouterr().err)


def test_compares_verdict_on_auto_leaves_out_calls_that_move_nothing():
    """A 0 B row times each path's fixed cost alone: it set the verdict's worst gap
    (+297%, +1060% in runs), though the bar is about moving data."""
    from pycoll import compare

    def point(size, auto_us):
        return compare.Point(size, {"ring": 10.0, "auto": auto_us}, {"ring": 1.0, "auto": 1.0},
                             {"ring": 0, "auto": 0}, "ring")

    result = compare.Comparison(Collective.ALLREDUCE, 2, "in-process", "t", ["ring"],
                                [point(0, 40.0), point(8, 10.5)])
    assert "worst over sizes that move data, against the fastest family: +5%" in (
        result.markdown())
    result.points = [point(0, 40.0)]
    assert "no size that moves data was measured" in result.markdown()


def test_compare_measures_each_element_count_once(tmp_path, capsys):
    """1 B and 2 B of float32 are both 0 elements: one 0 B row, not two."""
    assert main(["compare", "allreduce", "--ranks", "2", "-b", "1", "-e", "8", "-n", "1",
                 "-w", "0", "--output", str(tmp_path / "cmp")]) == 0
    rows = [line.split(" |")[0] for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and line[2].isdigit()]
    assert rows == ["| 0 B", "| 4 B", "| 8 B"]


@pytest.mark.parametrize("args,message", [
    (["compare", "alltoall", "--ranks", "2"], "nothing to compare"),
    # bench takes lists; compare one of each ("op='sum,max' is not a reduction")
    (["compare", "allreduce", "--ranks", "2", "-o", "sum,max"], "--op='sum,max': one per run; "
                                                                 "allowed: one name"),
    (["compare", "allreduce", "--ranks", "2", "-d", "all"], "--dtype='all': one per run"),
    (["compare", "foo", "--ranks", "2"], "allowed: allreduce, reduce_scatter, allgather, "
                                         "broadcast, reduce\n"),
    # no swept size holds a whole element (it priced 0 B, then scanned sizes 0, 0, ...)
    (["model", "--ranks", "2", "-b", "1", "-e", "8"], "sweep no whole element of float32"),
    (["model", "--ranks", "2", "-b", "4", "-e", "4", "-d", "float64"],
     "(8 B): they measure 4 B only; allowed: --min-bytes and --max-bytes 8 or more"),
    # it advised "a sweep reaching 8 B or more", which -e 8 is: -b 1 -f 16 measures 1 B alone
    (["model", "allgather", "--ranks", "7", "-b", "1", "-e", "8", "-d", "float64"],
     "they measure 1 B only; allowed: --min-bytes 8\n"),
    (["model", "--ranks", "2", "-b", "1", "-e", "15", "-d", "float64"],
     "allowed: --min-bytes 8 to 15\n"),
    # said as the flag, before measuring ("broadcast: root=5", from the call)
    (["compare", "broadcast", "--ranks", "2", "-r", "5"],
     "--root=5 is not a rank; allowed: 0..1\n"),
    (["explain", "broadcast", "--root", "9"], "--root=9 is not a rank; allowed: 0..3\n"),
    (["explain", "allreduce", "--segments", "0"], "--segments=0 is invalid"),
    (["model", "--ranks", "0"], "--ranks='0'"),
    # it priced on until memory ran out, without a word
    (["model", "--ranks", "8,99999999999"], "--ranks='8,99999999999'; allowed: comma-separated "
                                            "ints from 1 to 65536"),
    (["explain", "allreduce", "--ranks", "65"], "--ranks=65 is invalid; allowed: an int in 1..64"),
    (["model", "--topology", "moon"], "neither a built-in topology nor a file"),
    (["model", "gather"], "collective='gather'"),
    (["tune", "--repeats", "0"], "--repeats=0"),
    # the flag was not named: "size='1X' is invalid"
    (["model", "--ranks", "2", "-e", "1X"], "--max-bytes='1X' is invalid"),
    (["tune", "-e", "1X"], "--max-bytes='1X' is invalid"),
    (["compare", "allreduce", "--ranks", "2", "-b", "1X"], "--min-bytes='1X' is invalid"),
    # it wrote files named -.md and -.png
    (["compare", "allreduce", "--ranks", "2", "--output", "-"],
     "--output '-': not a file; allowed: a file path\n"),
    (["tune", "--output", "-"], "--output '-': not a file; allowed: a file path\n"),
    # allgather at 3 ranks: 8 B is 2 float32, no whole row per rank (bench measures 0 B)
    (["model", "allgather", "--ranks", "3", "-b", "8", "-e", "8"],
     "holds no whole float32 row per rank"),
])
def test_tools_name_bad_arguments(args, message, capsys):
    assert main(args) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("collective", ["reduce_scatter", "allgather", "broadcast", "reduce"])
def test_explain_refuses_a_family_without_the_schedule_before_printing(collective, capsys):
    """It printed that hierarchical_tree "runs as its flat schedule, shown here", then failed
    on its having no such schedule."""
    assert main(["explain", collective, "--algorithm", "hierarchical_tree"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert (f"--algorithm='hierarchical_tree' has no {collective} schedule; allowed for "
            f"{collective}: ") in captured.err


@pytest.mark.parametrize("collective", ["allreduce", "alltoall", "allgather"])
def test_explain_ignores_the_root_where_the_collective_has_none(collective, capsys):
    """As bench: --root applies to broadcast and reduce (explain refused --root 9 for
    allreduce)."""
    assert main(["explain", collective, "--root", "9"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("matches the numpy oracle")


def test_compare_at_one_rank_plots_without_a_warning(tmp_path, capsys):
    """busbw is 0 at one rank (nothing moves between ranks): its log axis warned "Data has
    no positive values"; algbw is plotted there instead."""
    pytest.importorskip("matplotlib")
    import warnings

    with warnings.catch_warnings():
        # matplotlib's own (its log axis); not a dependency's deprecation (matplotlib 3.7
        # beside pyparsing 3.3)
        warnings.simplefilter("error", UserWarning)
        warnings.simplefilter("error", RuntimeWarning)
        assert main(["compare", "allreduce", "--ranks", "1", "-b", "1K", "-e", "4K", "-n", "1",
                     "-w", "0", "--output", str(tmp_path / "cmp")]) == 0
    assert (tmp_path / "cmp.png").exists()


def test_model_prices_what_a_run_can_make(tmp_path, capsys):
    """A topology without segments (shared memory's tuning) was priced with them (rows no
    run makes); sizes are rounded as bench rounds them; equal times are no crossover (2
    ranks: tree and ring take the same steps)."""
    entry = scaling.builtin_topologies()["nvlink-ib"].to_json()
    path = tmp_path / "noseg.json"
    path.write_text(json.dumps({**entry, "segments": False}))
    assert main(["model", "--ranks", "8", "-b", "128M", "-e", "128M", "--topology",
                 str(path)]) == 0
    out = capsys.readouterr().out
    assert "×" not in out and "| 8 | 128 MiB |" in out
    assert main(["model", "allgather", "--ranks", "3", "-b", "1K", "-e", "1K"]) == 0
    assert "| 3 | 1020 B |" in capsys.readouterr().out
    assert main(["model", "--ranks", "2", "-b", "1K", "-e", "4M", "-f", "64"]) == 0
    assert "# 2 ranks: tree predicted faster than ring at no size" in capsys.readouterr().out
    # no row at 64 ranks (64 B holds no float32 per rank): no column of its families alone
    # (StopIteration), no crossover line for it
    assert main(["model", "allgather", "--ranks", "2,64", "-b", "8", "-e", "64",
                 "-f", "2"]) == 0
    out = capsys.readouterr().out
    assert "hierarchical" not in out and "# 64 ranks" not in out and "| 2 | 64 B |" in out
    tuning = tmp_path / "tuning.json"  # pycoll tune's file is not one topology: say where
    model.save_tuning([("local", scaling.builtin_topologies()["ethernet"])], tuning)
    assert main(["model", "--ranks", "8", "--topology", str(tuning)]) == 2
    assert (f"--topology {tuning} is a tuning file (pycoll tune's); allowed: one topology's "
            f"JSON, or PYCOLL_TUNING={tuning} with --topology tuned") in capsys.readouterr().err


def test_model_command_prints_every_algorithm_and_the_crossover(capsys):
    assert main(["model", "--ranks", "4,16", "-b", "16", "-e", "1M", "-f", "256",
                 "--topology", "ethernet"]) == 0
    out = capsys.readouterr().out
    assert "| 16 | 1 MiB |" in out and "halving_doubling" in out
    assert "# 16 ranks: tree predicted faster than ring" in out

def test_the_crossover_line_names_the_sizes_it_scanned(capsys):
    """It named the sweep's flags (8 B to 2 KiB) where the rows were 120 B and 2040 B: sizes
    are whole rows per rank, as bench measures them."""
    assert main(["model", "reduce_scatter", "--ranks", "3", "-b", "8", "-e", "4K"]) == 0
    out = capsys.readouterr().out
    assert "| 3 | 2040 B |" in out and "at no size from 24 B to 2040 B" in out


def test_worker_processes_price_what_this_process_prices(monkeypatch):
    """`pycoll model` at 4096 ranks played every rank of the tree in one process, for minutes
    with nothing printed; worker processes now price each segment count of each row."""
    ethernet = scaling.builtin_topologies()["ethernet"]
    keys = [(f, p, nbytes) for p in (3, 8) for nbytes in (64, 1 << 20)
            for f in ("ring", "tree", "halving_doubling")]
    with scaling.Pricer(Collective.ALLREDUCE, ethernet, itemsize=4, workers=2) as price:
        price.prefetch(keys)
        assert len(price._pending) == len(keys)  # priced by the workers, not here
        priced = [price(*key) for key in keys]
    assert priced == [scaling.predict_at_scale(Collective.ALLREDUCE, *key, ethernet, 4)
                      for key in keys]
    assert {e.nsegments for e in priced} != {1}  # the segment counts were compared
    # workers only where some family plays every rank of more than FULL_LIMIT
    nvlink_ib = scaling.builtin_topologies()["nvlink-ib"]
    assert scaling.workers_for(Collective.ALLREDUCE, [8, 64], nvlink_ib) == 1
    assert scaling.workers_for(Collective.ALLGATHER, [512], nvlink_ib) == 1  # tree left out
    cores = len(os.sched_getaffinity(0))  # the tree plays all 4096
    free = scaling.available_memory()
    assert free is None or free > 0
    monkeypatch.setattr(scaling, "available_memory", lambda: 64 * scaling.WORKER_BYTES)
    assert scaling.workers_for(Collective.ALLREDUCE, [8, 4096], nvlink_ib) == min(cores, 64)
    # as many as the free memory holds (one per core took ~430 MB each), at least one
    monkeypatch.setattr(scaling, "available_memory", lambda: 3 * scaling.WORKER_BYTES + 1)
    assert scaling.workers_for(Collective.ALLREDUCE, [4096], nvlink_ib) == min(cores, 3)
    monkeypatch.setattr(scaling, "available_memory", lambda: scaling.WORKER_BYTES - 1)
    assert scaling.workers_for(Collective.ALLREDUCE, [4096], nvlink_ib) == 1


@pytest.mark.parametrize("text,message", [
    ('{"intra": {"alpha": 1e-6}}', "KeyError: 'beta'"),
    ('{"gamma": "fast"}', "gamma='fast'; allowed: a number >= 0"),
    ('{"intra": {"alpha": -1, "beta": 1e-9}}', "a cost below 0"),
    ("[1, 2]", "is not a JSON object"),
    ('{"ranks_per_node": "8"}', "ranks_per_node='8'; allowed: an int >= 0"),
    ('{"gamma": -1}', "gamma=-1; allowed: a number >= 0"),
    ('{"ports": 3}', "ports=3; allowed: 'single', 'multi'"),  # named no file
    ('{"intra": {"alpha": "1e-6", "beta": 1e-9}}', "intra.alpha='1e-6'; allowed: a number"),
    ('{"name": 5}', "name=5; allowed: a string"),
    ('{"gamma": Infinity}', "not finite"),  # a table of inf
    ('{"call": 1e400}', "not finite"),
    ('{"curves": {"gamma": [[1e400, 1e-10]]}}', "curves['gamma']"),  # an OverflowError
])
def test_a_bad_topology_file_is_named_not_a_traceback(tmp_path, capsys, text, message):
    path = tmp_path / "topology.json"
    path.write_text(text)
    assert main(["model", "--ranks", "4", "-b", "8", "-e", "8", "--topology", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"topology {path}" in err and message in err


def test_tune_refuses_an_unwritable_output_before_measuring(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tune, "tune", lambda *args, **kwargs: pytest.fail("measured"))
    assert main(["tune", "--output", str(tmp_path), "--repeats", "1"]) == 2
    assert f"--output {tmp_path}: cannot write a file there" in capsys.readouterr().err
    measured = []  # a folder tune would create is fine
    monkeypatch.setattr(tune, "tune", lambda *args, **kwargs: measured.append(args[0]))
    assert main(["tune", "--output", str(tmp_path / "new" / "t.json"), "--repeats", "1"]) == 0
    assert measured == [tmp_path / "new" / "t.json"]


def test_a_tuning_file_keeps_the_fits_of_other_rank_counts(tmp_path):
    """Tuning at 2 ranks, then at 3, into one file: the 2-rank fits stayed (they were
    replaced by the 3-rank ones alone)."""
    path = tmp_path / "tuning.json"
    two, three = (replace(model.Topology(), nranks=n) for n in (2, 3))
    model.save_tuning([("shm", two)], path, fits={"shm@2": {"alpha": [1]}})
    model.save_tuning([("shm", three)], path, fits={"shm@3": {"alpha": [2]}})
    data = json.loads(path.read_text())
    assert data["fits"] == {"shm@2": {"alpha": [1]}, "shm@3": {"alpha": [2]}}
    assert [t.nranks for t in model.load_tuning(path)["shm"]] == [2, 3]


def test_the_soak_fails_its_run_on_a_wrong_result(monkeypatch, capsys):
    import runpy

    soak = runpy.run_path(str(Path(__file__).parent.parent / "bench" / "soak.py"))
    soak["soak"].__globals__["one_call"] = lambda rng, comm: False  # every call wrong
    monkeypatch.setattr(sys, "argv", ["soak.py", "5", "--ranks", "2", "--warmup", "0"])
    assert soak["main"]() == 1
    assert "10 wrong" in capsys.readouterr().out  # 5 calls on each of 2 ranks
    monkeypatch.setattr(sys, "argv", ["soak.py", "5", "--ranks", "0"])
    with pytest.raises(ValueError, match="nranks=0"):  # not taken for "no --ranks"
        soak["main"]()


def _summarize(folder, row) -> subprocess.CompletedProcess:
    (folder / "run.json").write_text(json.dumps([row]))
    return subprocess.run([sys.executable, str(Path(__file__).parent.parent / "bench" /
                                               "summarize.py"), str(folder)],
                          capture_output=True, text=True, timeout=60)


def test_summarize_names_rows_without_native_times(tmp_path):
    row = {"collective": "allreduce", "nranks": 2, "size": 8, "algorithm": "auto",
           "time_us": 1.0, "native_time_us": None, "wrong": 0, "busbw": 1.0,
           "native_busbw": None}
    done = _summarize(tmp_path, row)
    assert done.returncode == 1 and "run pycoll bench --against mpi" in done.stderr.replace(
        "`", "")
    row |= {"native_time_us": 2.0, "native_busbw": 0.5}  # auto alone: no "best" to name
    done = _summarize(tmp_path, row)
    assert done.returncode == 0 and "| 8 B | 1.000 | 0.500 | - | - | 2.00 | 0 |" in done.stdout
    row |= {"in_place_wrong": 3}  # a default run's in-place set counts too
    assert "| 8 B | 1.000 | 0.500 | - | - | 2.00 | 3 |" in _summarize(tmp_path, row).stdout


def test_tune_below_the_curves_sizes_writes_no_empty_curve(tmp_path, capsys):
    """Every size below tune.CURVE_FROM: no per-byte curve for the links (it printed and
    saved empty ones), the line's beta alone."""
    path = tmp_path / "tuning.json"
    assert main(["tune", "--output", str(path), "--repeats", "1", "-e", "4K",
                 "--ranks", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    curve_lines = [line for line in lines if "by operation size:" in line]
    assert curve_lines and all(not line.endswith(":") for line in curve_lines)
    [topology] = model.load_tuning(path)["local"]
    assert dict(topology.curves).keys() == {"gamma", "delta"}


def test_tune_rewrites_a_tuning_file_it_cannot_read(tmp_path, capsys):
    """The unreadable file's error says to run pycoll tune: that must then work."""
    path = tmp_path / "tuning.json"
    path.write_text("{ not json")
    with pytest.raises(ValueError, match="unreadable"):
        model.load_tuning(path)
    topology = scaling.builtin_topologies()["ethernet"]
    model.save_tuning([("local", topology)], path)
    assert [t.nranks for t in model.load_tuning(path)["local"]] == [topology.nranks]
    assert "writing a new one" in capsys.readouterr().err


def test_tune_names_the_field_it_cannot_read_before_rewriting_the_file(tmp_path, capsys):
    """A tuning file whose fits are not an object: tune said "dictionary update sequence
    element #0 has length 1; 2 is required; writing a new one", naming neither the file nor
    the field, and dropped the file's costs. It is refused as any bad field is, by name."""
    path = tmp_path / "tuning.json"
    model.save_tuning([("shm", replace(model.Topology(), nranks=4))], path)
    path.write_text(json.dumps(json.loads(path.read_text()) | {"fits": "x"}))
    with pytest.raises(ValueError, match="fits='x'"):
        model.load_tuning(path)
    model.save_tuning([("local", replace(model.Topology(), nranks=2))], path)
    assert (f"pycoll: tuning file {path}: fits='x'; allowed: an object of each tuning's fits "
            "by kind@ranks; run `pycoll tune` to rewrite it; writing a new one"
            ) in capsys.readouterr().err


def test_a_tuning_entry_that_is_not_an_object_is_named_not_a_traceback(tmp_path, capsys,
                                                                        monkeypatch):
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"transports": {"local": ["str"]}}))
    monkeypatch.setenv("PYCOLL_TUNING", str(path))
    assert main(["model", "--ranks", "4", "-b", "8", "-e", "8", "--topology", "tuned"]) == 2
    assert f"topology {path} [local, ? ranks]: 'str' is not a JSON object" in (
        capsys.readouterr().err)


def test_the_tune_command_rewrites_an_unreadable_default_file(tmp_path, capsys, monkeypatch):
    """`pycoll tune` is what the unreadable file's error says to run: its measurements read
    the file too (each call's costs) and it stopped there, whatever --output said. It
    measures with the default costs and writes the file afresh."""
    path = tmp_path / "tuning.json"
    path.write_text("{ not json")
    monkeypatch.setenv("PYCOLL_TUNING", str(path))
    assert main(["tune", "--repeats", "1", "-e", "4K", "--ranks", "2"]) == 0
    assert "writing a new one" in capsys.readouterr().err
    assert [t.nranks for t in model.load_tuning(path)["local"]] == [2]
    monkeypatch.setenv("PYCOLL_TUNING", str(tmp_path))  # a folder: refused before measuring
    monkeypatch.setattr(tune, "tune", lambda *args, **kwargs: pytest.fail("measured"))
    assert main(["tune", "--repeats", "1"]) == 2
    assert (f"the tuning file ($PYCOLL_TUNING, else the cache folder) {tmp_path}: cannot "
            "write a file there") in capsys.readouterr().err


def test_a_tuning_path_that_names_a_folder_or_a_topology_says_so(tmp_path, capsys, monkeypatch):
    """PYCOLL_TUNING naming a folder said "unreadable (IsADirectoryError...); run `pycoll tune`
    to rewrite it", which cannot; naming a topology's JSON said "KeyError('transports')", and
    `pycoll tune` then replaced the topology with its costs."""
    topology_file = tmp_path / "ethernet.json"
    topology_file.write_text(json.dumps(scaling.builtin_topologies()["ethernet"].to_json()))
    kept = topology_file.read_text()
    with pytest.raises(ValueError, match=f"^tuning file {tmp_path} is a folder; allowed: a "
                                         "file's path"):
        model.load_tuning(tmp_path)
    with pytest.raises(ValueError, match=f"^tuning file {topology_file} holds one topology "
                                         r"\(as `pycoll model --topology` reads\)"):
        model.load_tuning(topology_file)
    monkeypatch.setattr(tune, "tune", lambda *args, **kwargs: pytest.fail("measured"))
    assert main(["tune", "--repeats", "1", "--output", str(topology_file)]) == 2
    monkeypatch.setenv("PYCOLL_TUNING", str(topology_file))
    assert main(["tune", "--repeats", "1"]) == 2
    err = capsys.readouterr().err
    for name in ("--output", "PYCOLL_TUNING"):
        assert (f"pycoll tune: {name} {topology_file} holds one topology (as `pycoll model "
                "--topology` reads), not the costs `pycoll tune` writes; allowed: a tuning "
                "file, or a new path") in err, err
    assert topology_file.read_text() == kept
    assert scaling.topology_named(str(topology_file)).name.startswith("ethernet")


def test_no_home_folder_means_no_tuning_file_where_none_is_named(monkeypatch, capsys):
    """HOME unset for a user id with no passwd entry (an arbitrary container uid): every
    collective raised RuntimeError (Could not determine home directory), reading the optional
    tuning file; `pycoll demo` too. The built-in costs, as with no file; `pycoll tune` says
    where to point it."""
    for name in ("HOME", "XDG_CACHE_HOME", model.TUNING_ENV):
        monkeypatch.delenv(name, raising=False)

    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    assert model.load_tuning() == {}
    assert pycoll.run_local(2, lambda: pycoll.allreduce(np.arange(3.0)).tolist()) == [
        [0.0, 2.0, 4.0]] * 2
    assert main(["demo"]) == 0
    monkeypatch.setattr(tune, "tune", lambda *args, **kwargs: pytest.fail("measured"))
    assert main(["tune", "--repeats", "1"]) == 2
    assert ("pycoll tune: the tuning file has no path: HOME is unset and this user has no home "
            "folder; allowed: PYCOLL_TUNING (the file) or XDG_CACHE_HOME set"
            ) in capsys.readouterr().err


@pytest.mark.parametrize("named", [False, True])
def test_a_tuning_file_that_cannot_be_looked_for(monkeypatch, tmp_path, named):
    """A home this user may not enter (a container run as another user than its image's
    HOME=/root): Path.exists raised PermissionError out of every collective. Unnamed, the file
    is optional: the built-in costs; named by PYCOLL_TUNING, it is said unreadable."""
    monkeypatch.delenv(model.TUNING_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    if named:
        monkeypatch.setenv(model.TUNING_ENV, str(tmp_path / "tuning.json"))

    def refused(self: Path, *args, **kwargs) -> bool:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "exists", refused)
    if not named:
        assert model.load_tuning() == {}
        return
    with pytest.raises(ValueError, match=r"^tuning file .*tuning\.json is unreadable "
                                         r"\(PermissionError\(13, 'Permission denied'\)\); "
                                         "allowed: a path this user can read, or PYCOLL_TUNING "
                                         "unset$"):
        model.load_tuning()


def test_a_terminal_without_the_tables_characters_or_none_at_all(tmp_path):
    """A Latin-1 stdout: compare measured, then crashed printing its table's µ and ≥, and
    wrote no file. Stdout closed: every command ended in a traceback (sys.stdout is None)."""
    env = {**os.environ, "PYTHONIOENCODING": "latin-1"}
    done = subprocess.run(
        [*PYTHON, "-m", "pycoll", "compare", "allreduce", "--ranks", "2", "-b",
         "8", "-e", "64", "-n", "1", "-w", "0", "--output", str(tmp_path / "c")],
        capture_output=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert b"no size at ? 64 KiB was measured" in done.stdout  # ≥ shown as ?
    assert "≥ 64 KiB" in (tmp_path / "c.md").read_text(encoding="utf-8")
    closed = subprocess.run(f"{' '.join(PYTHON)} -m pycoll demo >&-", shell=True,
                            capture_output=True, text=True, timeout=120)
    assert (closed.returncode, closed.stderr) == (0, "")


@pytest.mark.parametrize("args,says", [
    (["-e", "8"], "--max-bytes='8' leaves 1 size(s) of [8, 64] to fit; allowed: 64 bytes"),
    (["-e", "4"], "--max-bytes='4' leaves 0 size(s)"),
    (["--ranks", "1,2"], "--ranks='1,2'; allowed: rank counts >= 2"),
])
def test_tune_refuses_what_it_cannot_fit(tmp_path, capsys, args, says):
    """One size cannot fit a fixed cost and a cost per byte (it wrote a tuning file that
    priced every other size from that one point)."""
    path = tmp_path / "tuning.json"
    assert main(["tune", "--output", str(path), "--repeats", "1", *args]) == 2
    assert says in capsys.readouterr().err
    assert not path.exists()


def test_topology_files_load_by_path(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(scaling.builtin_topologies()["ethernet"].to_json()))
    assert scaling.topology_named(str(path)).ranks_per_node == 1


def test_tune_and_compare_under_mpiexec(tmp_path):
    """The MPI kind: node detection, pairs of MPI ranks, rank 0 writing for all."""
    import os
    import subprocess
    import sys

    from test_mpi import mpiexec

    path = tmp_path / "tuning.json"
    env = {**os.environ, "PYCOLL_TUNING": str(path)}
    done = subprocess.run(
        [mpiexec(), "-n", "2", sys.executable, "-m", "pycoll", "tune", "-e", "64K",
         "--repeats", "2", "--ranks", "2"],
        capture_output=True, text=True, timeout=180, env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    tuned = model.load_tuning(path)
    # two processes on one node talk through shared memory: the tuning is that kind's
    assert [t.nranks for t in tuned["shm"]] == [2] and tuned["shm"][0].intra.alpha > 0
    done = subprocess.run(
        [mpiexec(), "-n", "2", sys.executable, "-m", "pycoll", "compare", "allgather", "-b",
         "1K", "-e", "16K", "-f", "4", "-n", "2", "-w", "1", "--output",
         str(tmp_path / "cmp")],
        capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    table = (tmp_path / "cmp.md").read_text()
    assert "allgather, 2 ranks (MPI)" in table and "mpiexec -n 2 pycoll compare" in table
    assert "tuned at 2 ranks" in table


def test_tune_under_mpiexec_stops_every_rank_on_one_ranks_bad_output(tmp_path):
    """--output writable on rank 0 and not on rank 1 (another node's file system): rank 1
    stopped and rank 0 waited for it forever in the first measurement."""
    from test_mpi import mpiexec

    good, bad = tmp_path / "good", tmp_path / "bad"
    good.mkdir()
    bad.mkdir()
    (bad / "sub").write_text("a file where a folder would be")
    tune_args = [sys.executable, "-m", "pycoll", "tune", "-e", "64K", "--repeats", "1",
                 "--ranks", "2", "--output", "sub/t.json"]
    done = subprocess.run(
        [mpiexec(), "-n", "1", "-wdir", str(good), *tune_args, ":",
         "-n", "1", "-wdir", str(bad), *tune_args],
        capture_output=True, text=True, timeout=60,
        env={**__import__("os").environ, "PYCOLL_TUNING": str(tmp_path / "t.json")})
    assert done.returncode == 2, done.stdout + done.stderr
    assert "pycoll tune (rank 1): --output sub/t.json: cannot write a file there" in done.stderr
    assert not (good / "sub").exists()


TUNE_THEN_CALL = """
import pycoll
from pycoll import model, select, tune
from pycoll.spaces import HOST
world = pycoll.world()
tune.tune(None, repeats=1, sizes=[8, 64, 4096], local_ranks=(), print_=lambda line: None)
used = select.topology_for(world, HOST)
saved = model.nearest(model.load_tuning()[world.host_kind()], world.size)
print(f"rank {world.rank} uses the new costs: {used.intra == saved.intra}", flush=True)
"""


def test_tune_in_a_program_sets_the_costs_its_later_calls_use(tmp_path):
    """The world's costs are shared by its first call; tune's own calls came first, so the
    world went on choosing by the costs from before tuning."""
    import os
    import subprocess
    import sys

    from test_mpi import mpiexec

    env = {**os.environ, "PYCOLL_TUNING": str(tmp_path / "tuning.json")}
    done = subprocess.run([mpiexec(), "-n", "2", sys.executable, "-c", TUNE_THEN_CALL],
                          capture_output=True, text=True, timeout=180, env=env)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "rank 0 uses the new costs: True" in output and "rank 1 uses the new costs: True" \
        in output, output


def test_the_soak_runs_in_process():
    import runpy

    soak = runpy.run_path(str(Path(__file__).parent.parent / "bench" / "soak.py"))["soak"]
    results = pycoll.run_local(3, soak, 200, 7, 50)
    assert all(calls == 200 and wrong == 0 for calls, wrong, _, _ in results)


def test_model_prices_each_rank_count_with_the_families_that_apply_there(capsys):
    """A row does not depend on the other rank counts asked for: at 8 ranks (one node of
    nvlink-ib) the hierarchical families do not apply ("—"); at 16 (two nodes) they do."""
    assert main(["model", "--ranks", "8,16", "-b", "1M", "-e", "1M"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("| ranks"))
    eight = next(line for line in out.splitlines() if line.startswith("| 8 |"))
    sixteen = next(line for line in out.splitlines() if line.startswith("| 16 |"))
    assert "hierarchical µs" in header
    column = header.split(" | ").index("hierarchical µs (busbw GB/s)")
    assert eight.split(" | ")[column] == "—" and sixteen.split(" | ")[column] != "—"
    alone = main(["model", "--ranks", "16", "-b", "1M", "-e", "1M"])
    assert alone == 0 and sixteen in capsys.readouterr().out  # the same row, asked alone
    assert "at no size from" in out or "at least (scanned 1 MiB to 1 MiB)" in out


def test_bench_output_options(tmp_path, capsys):
    # --json -: stdout is the JSON alone (the table goes to stderr)
    assert main(["bench", "--ranks", "2", "-e", "64", "-n", "1", "-w", "0", "--json", "-"]) == 0
    captured = capsys.readouterr()
    assert len(json.loads(captured.out)) >= 1 and "pycoll bench" in captured.err
    # an unwritable path is refused before anything runs
    assert main(["bench", "--ranks", "2", "-e", "16", "--json", str(tmp_path / "no/x.json")]) == 2
    assert "--json" in capsys.readouterr().err
    # an empty --algorithm list runs nothing: refused
    assert main(["bench", "--ranks", "2", "-e", "8", "--algorithm", ","]) == 2
    assert "--algorithm names no algorithm" in capsys.readouterr().err
    # nccl-tests' names: float is float32, int is int32
    assert main(["bench", "--ranks", "2", "-b", "64", "-e", "64", "-n", "1", "-w", "0",
                 "-d", "float", "--json", str(tmp_path / "f.json")]) == 0
    assert json.loads((tmp_path / "f.json").read_text())[0]["type"] == "float32"


def test_compare_says_when_auto_took_the_one_shot(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("PYCOLL_HOST_TRANSPORT", "shm")
    assert main(["compare", "allreduce", "--ranks", "3", "-b", "64", "-e", "64", "-n", "1",
                 "-w", "0", "--output", str(tmp_path / "c")]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines()
               if line.startswith("| 64 B"))
    assert "| one-shot |" in row and "(-)" in row


def test_compare_says_when_pycoll_algo_forces_auto(monkeypatch, tmp_path, capsys):
    """auto's column is then the forced family's, whatever the model says: the report says
    so (it did not)."""
    monkeypatch.setenv("PYCOLL_ALGO", "allreduce:tree")
    assert main(["compare", "allreduce", "--ranks", "2", "-b", "1K", "-e", "1K", "-n", "1",
                 "-w", "0", "--output", str(tmp_path / "c")]) == 0
    assert "; auto runs tree, as PYCOLL_ALGO forces" in capsys.readouterr().out


def test_the_small_call_scripts_run(capsys):
    """bench/call_overhead.py (every collective, and one AllReduce layer by layer),
    bench/back_to_back.py (under mpiexec) and bench/plan_cost.py print a time for each of
    their rows."""
    import os
    import re
    import runpy
    import subprocess
    import sys

    from test_mpi import mpiexec

    bench = Path(__file__).parent.parent / "bench"
    script = runpy.run_path(str(bench / "call_overhead.py"))
    script["main"].__globals__.update(NUMBER=20, REPEAT=2)  # that it runs, not its figures
    script["main"](1)
    script["main"](1, "--layers")
    lines = capsys.readouterr().out.splitlines()
    names = [line.split(":")[0].strip() for line in lines]
    assert names[:2] == ["allreduce (out given)", "allreduce"] and "alltoall" in names
    assert names[-4:] == ["public call", "api._execute", "kept player", "sendrecv + reduce"]
    assert all(re.search(r": +\d+\.\d\d us per call", line) for line in lines)
    done = subprocess.run(
        [mpiexec(), "-n", "2", sys.executable, str(bench / "back_to_back.py"), "1"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYCOLL_HOST_TRANSPORT": "mpi"})
    assert done.returncode == 0, done.stdout + done.stderr
    rows = re.findall(r"^ *(native|pycoll|Sendrecv \+ add): +\d+\.\d\d us +\((\d+\.\d\d) x native",
                      done.stdout, re.M)
    assert [name for name, _ in rows] == ["native", "pycoll", "Sendrecv + add"], done.stdout
    assert rows[0][1] == "1.00"
    runpy.run_path(str(bench / "plan_cost.py"))["main"](1)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 8 and all(re.search(r"ranks, +\w+: +\d+\.\d\d ms per new size", line)
                                   for line in lines), lines


def test_the_ipc_smoke_test_names_the_step_that_failed():
    """bench/ipc_smoke.py (gpu_check.sh's CUDA IPC check with CuPy alone) says on each rank
    which step failed and how, and exits, here where there is no GPU (or no CuPy)."""
    from test_mpi import mpiexec

    bench = Path(__file__).resolve().parent.parent / "bench"
    done = subprocess.run([mpiexec(), "-n", "2", sys.executable, str(bench / "ipc_smoke.py")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0, done.stdout
    for rank in (0, 1):
        assert re.search(rf"rank {rank}: cuda ipc smoke failed while (importing CuPy|choosing "
                         r"the device): \w+", done.stdout), done.stdout + done.stderr
    assert "cuda ipc smoke: ok" not in done.stdout


def test_model_leaves_out_the_tree_allgather_beyond_64_ranks(capsys):
    """It carries every rank's block through each level, no two ranks alike: p² transfers
    to play on every rank (`pycoll model allgather` at its default 512 and 4096 ranks ran
    for hours)."""
    nvlink_ib = scaling.topology_named("nvlink-ib")
    for collective in (Collective.ALLGATHER, Collective.REDUCE_SCATTER):
        assert scaling.applies(collective, "tree", 64, nvlink_ib)
        assert not scaling.applies(collective, "tree", 65, nvlink_ib)
        assert scaling.applies(collective, "ring", 4096, nvlink_ib)
    assert scaling.applies(Collective.ALLREDUCE, "tree", 4096, nvlink_ib)
    rows = scaling.table(Collective.ALLGATHER, [128], [1 << 20], nvlink_ib)
    assert {e.algorithm for e in rows[0] if e is not None} == {
        "ring", "halving_doubling", "direct", "hierarchical"}
    # nor is it priced for the tree-against-ring line (which priced it whatever the table did)
    assert main(["model", "allgather", "--ranks", "8,128", "-b", "1M", "-e", "1M"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if " ranks: tree" in line]
    assert [line.split(":")[0] for line in lines] == ["# 8 ranks"]


def test_the_command_line_writes_each_error_line_in_one_write():
    """Python writes stderr's text and its newline apart: under mpiexec two ranks' errors
    ran together on one line ("...count and dtypepycoll bench: ...")."""
    done = subprocess.run(
        [*PYTHON, "-c", "import sys\nfrom pycoll.cli import main\n"
         "main(['explain', 'allreduce', '--ranks', '2'])\n"
         "print(sys.stderr.write_through, sys.stderr.line_buffering)"],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "False True"
