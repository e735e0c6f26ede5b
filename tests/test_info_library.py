"""``python -m pympar info`` names the MPI library in one line that the pages' column holds."""

from __future__ import annotations

import pytest

from pympar import __main__ as cli

OPEN_MPI_4 = ("Open MPI v4.1.4, package: Debian OpenMPI, ident: 4.1.4, repo rev: v4.1.4, May "
              "26, 2022\x00")
OPEN_MPI_5 = ("Open MPI v5.0.11, package: Open MPI user@localhost Distribution, ident: 5.0.11, "
              "repo rev: v5.0.11rc1, Sep 16, 2026 ")
MPICH = "MPICH Version:      5.0.2\nMPICH Release date: Fri Sep 25 20:45:26 UTC 2026\n"


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("version, shown", [
    (OPEN_MPI_4, "Open MPI v4.1.4, package: Debian OpenMPI, ident: 4.1.4"),
    (OPEN_MPI_5, "Open MPI v5.0.11, package: Open MPI user@localhost Distribution"),
    (MPICH, "MPICH Version: 5.0.2"),
    # A first field longer than the width is kept whole, and alone.
    ("Library " + "x" * 70 + ", release 1", "Library " + "x" * 70)])
def test_the_library_line_keeps_the_leading_fields_that_fit(version, shown):
    assert cli._library_name(version.replace("\x00", "")) == shown.strip()


@pytest.mark.mpi(min_size=1)
def test_the_loaded_library_fits_the_column():
    # 18 characters of label: the line within the 88 columns of the pages' code blocks.
    name = cli._library_name()
    assert name and 18 + len(name) <= 88, name
