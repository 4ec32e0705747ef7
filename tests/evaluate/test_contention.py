"""How busy the machine was, read from a fake /proc: PSI where the kernel has it, else the run
queue, and steal; the figures name the signal that measured the pressure."""

import os
from pathlib import Path

import pytest

from kiln.evaluate.contention import PSI, RUN_QUEUE, Reading, Watch, as_metrics, between, read, usable_cpus


def _proc(root: Path, *, running: int, steal: int = 0, busy: int = 1000, psi_us: int | None = None) -> Path:
    """A /proc with `stat` (cpu line: user nice system idle iowait irq softirq steal) and, given
    `psi_us`, `pressure/cpu`; each file replaced whole, as the kernel serves it."""
    root.mkdir(exist_ok=True)
    files = {"stat": f"cpu  {busy} 0 0 1000 0 0 0 {steal} 0 0\ncpu0 1 0 0 1 0 0 0 0 0 0\nctxt 5\n"
                     f"procs_running {running}\nprocs_blocked 0\n"}
    if psi_us is not None:
        files["pressure/cpu"] = f"some avg10=0.00 avg60=0.00 avg300=0.00 total={psi_us}\n" \
                                "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
    for name, text in files.items():
        (root / name).parent.mkdir(exist_ok=True)
        (root / (name + ".tmp")).write_text(text)
        os.replace(root / (name + ".tmp"), root / name)
    return root


def test_without_psi_the_run_queue_measures_the_pressure_and_is_named(tmp_path):
    cpus = usable_cpus()
    # Twice as many runnable tasks as this process's CPUs besides the thread reading: every CPU has one waiting.
    with Watch(_proc(tmp_path / "proc", running=2 * cpus + 1)) as watch:
        got = watch.figures()
    assert got["signal"] == RUN_QUEUE and got["cpu_pressure"] == 1.0
    assert as_metrics(got) == {"bench_run_queue_pressure": 1.0}
    # The reader alone plus one task per CPU: nobody waits.
    with Watch(_proc(tmp_path / "quiet", running=cpus + 1)) as watch:
        assert watch.figures()["cpu_pressure"] == 0.0


def test_run_queue_samples_are_read_as_psi_reads_the_cpus():
    cpus = usable_cpus()
    got = between(Reading(0.0, None, None, None, cpus + 1), Reading(1.0, None, None, None, cpus + 1), [cpus + 2] * 2)
    # PSI's "some" summed over CPUs: one task waiting on `cpus` CPUs is 1 / cpus, in 2 of the 4 samples
    assert got["signal"] == RUN_QUEUE and got["cpu_pressure"] == pytest.approx(min(1, 1 / cpus) / 2)


def test_psi_is_preferred_and_named(tmp_path):
    proc = _proc(tmp_path / "proc", running=50, psi_us=1_000_000)
    start = read(proc)
    got = between(start, read(proc))
    assert got["signal"] == PSI and got["cpu_pressure"] == 0.0  # no stall since the first reading
    assert as_metrics(got) == {"bench_cpu_pressure": 0.0}
    with Watch(proc) as watch:
        assert watch._thread is None  # PSI counts by itself: nothing to sample


def test_steal_is_read_from_proc_stat(tmp_path):
    proc = _proc(tmp_path / "proc", running=1, steal=100, busy=1000)
    with Watch(proc) as watch:
        _proc(proc, running=1, steal=130, busy=1100)  # 100 more busy jiffies, +30 steal: 30 of 130
        got = watch.figures()
    assert got["cpu_steal"] == pytest.approx(30 / 130)
    assert as_metrics(got)["bench_cpu_steal"] == pytest.approx(30 / 130)


def test_no_proc_names_no_signal(tmp_path):
    (tmp_path / "empty").mkdir()
    with Watch(tmp_path / "empty") as watch:
        got = watch.figures()
    assert got["signal"] is None and got["cpu_pressure"] is None and got["cpu_steal"] is None
    assert as_metrics(got) == {}


def test_over_takes_only_the_run_queue_samples_inside_its_window(tmp_path):
    """One arm's half of a pair: the samples the watch took between its two readings, not the whole run's."""
    cpus = usable_cpus()
    with Watch(_proc(tmp_path / "proc", running=cpus + 1)) as watch:
        watch.samples[:] = [(1.0, 2 * cpus + 1), (5.0, cpus + 1)]  # busy early, quiet in the window
        start, end = Reading(4.0, None, None, None, cpus + 1), Reading(6.0, None, None, None, cpus + 1)
        assert watch.over(start, end)["cpu_pressure"] == 0.0
        assert watch.over(Reading(0.5, None, None, None, cpus + 1), end)["cpu_pressure"] == pytest.approx(1 / 4)
