"""ColossalAI-style 3D tensor-parallel group initializers, as views of a ``Mesh``.

A 3D tensor-parallel group of size ``d**3`` is a cube with coordinates
``(i, j, k)``; within the ``h``-th tensor group (consecutive blocks of ``d**3``
ranks) the rank at ``(i, j, k)`` is ``h*d**3 + i + d*(j + d*k)``. The five
groups are the lines and planes of that cube:

========================  =====================  =====================
mode                      varies                 e.g. d=2, 8 ranks
========================  =====================  =====================
``3d_input``              j                      [0,2] [4,6] [1,3] [5,7]
``3d_weight``             i                      [0,1] [2,3] [4,5] [6,7]
``3d_output``             k                      [0,4] [2,6] [1,5] [3,7]
``3d_input_x_weight``     (i, j), i fastest      [0,1,2,3] [4,5,6,7]
``3d_output_x_weight``    (i, k), i fastest      [0,1,4,5] [2,3,6,7]
========================  =====================  =====================

(the table lists each group once; every rank belongs to one group of each mode).
"""

from __future__ import annotations

import enum
from typing import Any

from mpi4py import MPI

from .group import Group
from .mesh import Mesh

__all__ = [
    "ParallelMode",
    "AXES_3D",
    "MODE_AXES",
    "cube_depth",
    "make_3d_groups",
    "ProcessGroupInitializer",
    "Initializer_3D_Input",
    "Initializer_3D_Weight",
    "Initializer_3D_Output",
    "Initializer_3D_InputxWeight",
    "Initializer_3D_OutputxWeight",
    "Initializer_3D",
]


class ParallelMode(str, enum.Enum):
    """The five 3D tensor-parallel groups."""

    PARALLEL_3D_INPUT = "3d_input"
    PARALLEL_3D_WEIGHT = "3d_weight"
    PARALLEL_3D_OUTPUT = "3d_output"
    PARALLEL_3D_INPUT_X_WEIGHT = "3d_input_x_weight"
    PARALLEL_3D_OUTPUT_X_WEIGHT = "3d_output_x_weight"


#: Mesh axis names of the cube coordinates (i, j, k), innermost first.
AXES_3D = ("tp_i", "tp_j", "tp_k")

#: The cube axes each 3D group spans.
MODE_AXES: dict[ParallelMode, tuple[str, ...]] = {
    ParallelMode.PARALLEL_3D_INPUT: ("tp_j",),
    ParallelMode.PARALLEL_3D_WEIGHT: ("tp_i",),
    ParallelMode.PARALLEL_3D_OUTPUT: ("tp_k",),
    ParallelMode.PARALLEL_3D_INPUT_X_WEIGHT: ("tp_i", "tp_j"),
    ParallelMode.PARALLEL_3D_OUTPUT_X_WEIGHT: ("tp_i", "tp_k"),
}


def cube_depth(tensor_parallel_size: int) -> int:
    """Return ``d`` with ``d**3 == tensor_parallel_size``.

    Raises
    ------
    ValueError
        When the size is not a perfect cube.
    """
    depth = round(tensor_parallel_size ** (1.0 / 3.0))
    if depth < 1 or depth ** 3 != tensor_parallel_size:
        raise ValueError(f"3D tensor parallelism needs a cube tensor-parallel size "
                         f"(1, 8, 27, 64, ...), got {tensor_parallel_size}")
    return depth


def make_3d_groups(mesh: Mesh) -> dict[ParallelMode, Group]:
    """Create the five 3D groups of a mesh with axes ``tp_i, tp_j, tp_k``; collective."""
    return {mode: mesh.group(*axes, key=mode.value) for mode, axes in MODE_AXES.items()}


class ProcessGroupInitializer:
    """Base of the initializers: the communicator and the tensor-parallel size.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm, optional
        Communicator whose ranks are laid out; ``MPI.COMM_WORLD`` by default.
    tensor_parallel_size : int, optional
        Ranks per tensor-parallel group (``d**3``); the communicator's size
        by default. Tensor-parallel groups are consecutive blocks of ranks.
    """

    def __init__(self, comm: MPI.Intracomm | None = None,
                 tensor_parallel_size: int | None = None) -> None:
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.world_size = self.comm.Get_size()
        self.rank = self.comm.Get_rank()
        self.tensor_parallel_size = (self.world_size if tensor_parallel_size is None
                                     else int(tensor_parallel_size))
        if self.tensor_parallel_size < 1 or self.world_size % self.tensor_parallel_size:
            raise ValueError(f"tensor-parallel size {self.tensor_parallel_size} must be >= 1 "
                             f"and divide the world size {self.world_size}")

    def init_dist_group(self) -> Any:
        """Create the groups; implemented by subclasses."""
        raise NotImplementedError


class _Initializer3DLine(ProcessGroupInitializer):
    """One of the five 3D groups; subclasses set ``mode``."""

    mode: ParallelMode

    def __init__(self, num_group: int, depth: int, *args: Any) -> None:
        super().__init__(*args)
        if depth < 1 or num_group < 1 or num_group * depth ** 3 != self.world_size:
            raise ValueError(f"{type(self).__name__}: num_group={num_group} groups of depth "
                             f"{depth} (size {depth ** 3}) do not tile {self.world_size} ranks")
        if depth ** 3 != self.tensor_parallel_size:
            raise ValueError(f"{type(self).__name__}: depth {depth} does not match "
                             f"tensor-parallel size {self.tensor_parallel_size}")
        self.num_group = num_group
        self.depth = depth

    def init_dist_group(self) -> tuple[int, int, Group, list[int], ParallelMode]:
        """Create this rank's group; collective over the communicator.

        Returns
        -------
        tuple
            ``(local_rank, group_world_size, process_group, ranks_in_group, mode)``
            where ``process_group`` is a :class:`~pympar.group.Group`.
        """
        d = self.depth
        mesh = Mesh(self.comm, {"tp_i": d, "tp_j": d, "tp_k": d, "block": self.num_group},
                    "tp_i-tp_j-tp_k-block")
        group = mesh.group(*MODE_AXES[self.mode], key=self.mode.value)
        return group.rank, group.size, group, list(group.ranks), self.mode


def _line_initializer(suffix: str, mode: ParallelMode, among: str) -> type[_Initializer3DLine]:
    """The initializer class ``Initializer_3D_<suffix>`` of the groups of ``mode``."""
    name = f"Initializer_3D_{suffix}"
    doc = f"""3D tensor-parallel groups among {among}.

    Parameters
    ----------
    num_group : int
        Number of tensor-parallel groups (world size / ``depth**3``).
    depth : int
        Depth ``d`` of 3D parallelism.
    *args
        ``(comm, tensor_parallel_size)`` of :class:`ProcessGroupInitializer`.
    """
    return type(name, (_Initializer3DLine,),
                {"mode": mode, "__doc__": doc, "__module__": __name__, "__qualname__": name})


_LINE_INITIALIZERS = tuple(_line_initializer(*line) for line in (
    ("Input", ParallelMode.PARALLEL_3D_INPUT, "input (coordinate ``j`` varies)"),
    ("Weight", ParallelMode.PARALLEL_3D_WEIGHT, "weight (coordinate ``i`` varies)"),
    ("Output", ParallelMode.PARALLEL_3D_OUTPUT, "output (coordinate ``k`` varies)"),
    ("InputxWeight", ParallelMode.PARALLEL_3D_INPUT_X_WEIGHT,
     "input x weight (``i`` and ``j`` vary, ``i`` fastest)"),
    ("OutputxWeight", ParallelMode.PARALLEL_3D_OUTPUT_X_WEIGHT,
     "output x weight (``i`` and ``k`` vary, ``i`` fastest)"),
))
(Initializer_3D_Input, Initializer_3D_Weight, Initializer_3D_Output, Initializer_3D_InputxWeight,
 Initializer_3D_OutputxWeight) = _LINE_INITIALIZERS


class Initializer_3D(ProcessGroupInitializer):
    """The single entry point to 3D tensor-parallel initialization.

    Parameters
    ----------
    *args
        ``(comm, tensor_parallel_size)`` of :class:`ProcessGroupInitializer`;
        the tensor-parallel size must be a cube ``d**3``.
    """

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.depth = cube_depth(self.tensor_parallel_size)
        self.num_group = self.world_size // self.tensor_parallel_size
        self._args = args

    def init_dist_group(self) -> list[tuple[int, int, Group, list[int], ParallelMode]]:
        """Create all five 3D groups; collective over the communicator.

        Returns
        -------
        list of tuple
            The ``init_dist_group()`` results of the input, weight, output,
            input x weight and output x weight initializers, in that order.
        """
        return [cls(self.num_group, self.depth, *self._args).init_dist_group()
                for cls in _LINE_INITIALIZERS]
