"""The current parallel state: DP, CP and TP groups cut from one ``Mesh``.

``initialize_parallel`` lays the world out as ``tp x cp x dp`` (innermost first
by default) and creates the tensor, context, data and data-context groups once,
collectively. The 16 getters of MindScience's ``distributed.manager`` read that
state. It is the one piece of module-level state in pympar.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from mpi4py import MPI

from . import faults
from .group import Group
from .initializer_3d import AXES_3D, ParallelMode, cube_depth, make_3d_groups
from .mesh import Mesh, check_sizes, parse_order

__all__ = [
    "ParallelState",
    "initialize_parallel",
    "destroy_parallel",
    "is_initialized",
    "get_parallel_state",
    "get_3d_group",
    "get_tensor_parallel_group",
    "get_tensor_parallel_group_name",
    "get_tensor_parallel_rank",
    "get_tensor_parallel_world_size",
    "get_context_parallel_group",
    "get_context_parallel_group_name",
    "get_context_parallel_rank",
    "get_context_parallel_world_size",
    "get_data_parallel_group",
    "get_data_parallel_group_name",
    "get_data_parallel_rank",
    "get_data_parallel_world_size",
    "get_data_context_parallel_group",
    "get_data_context_parallel_group_name",
    "get_data_context_parallel_rank",
    "get_data_context_parallel_world_size",
]

TENSOR_PARALLEL_MODES = ("1d", "3d")


@dataclass
class ParallelState:
    """The groups of one parallel layout.

    Attributes
    ----------
    mesh : Mesh
        Axes ``tp``, ``cp``, ``dp`` (in 3D mode ``tp`` is split into the cube
        axes ``tp_i``, ``tp_j``, ``tp_k``, innermost first, in its place).
    tensor, context, data, data_context : Group
        This rank's TP, CP, DP and DP x CP groups.
    tensor_parallel_mode : str
        ``"1d"`` or ``"3d"``.
    depth : int
        Cube depth ``d`` in 3D mode (``tensor.size == d**3``), else 0.
    groups_3d : dict of ParallelMode to Group
        The five 3D groups inside this rank's TP group (3D mode only).
    """

    mesh: Mesh
    tensor: Group
    context: Group
    data: Group
    data_context: Group
    tensor_parallel_mode: str = "1d"
    depth: int = 0
    groups_3d: dict[ParallelMode, Group] = field(default_factory=dict)

    def all_groups(self) -> list[Group]:
        """Every group of the state, in creation order."""
        return [self.tensor, self.context, self.data, self.data_context,
                *self.groups_3d.values()]


_state: ParallelState | None = None


def _check_arguments(tensor_parallel_size: int, context_parallel_size: int, order: str,
                     tensor_parallel_mode: str, world: int) -> dict[str, int]:
    sizes = check_sizes({"tp": tensor_parallel_size, "cp": context_parallel_size})
    if tensor_parallel_mode not in TENSOR_PARALLEL_MODES:
        raise ValueError(f"tensor_parallel_mode must be one of {TENSOR_PARALLEL_MODES}, "
                         f"not {tensor_parallel_mode!r}")
    model = sizes["tp"] * sizes["cp"]
    if world % model:
        raise ValueError(f"world size {world} is not divisible by tensor_parallel_size "
                         f"{sizes['tp']} x context_parallel_size {sizes['cp']} = {model}")
    sizes["dp"] = world // model
    parse_order(order, sizes)
    if tensor_parallel_mode == "3d":
        cube_depth(sizes["tp"])
    return sizes


def initialize_parallel(tensor_parallel_size: int = 1, context_parallel_size: int = 1,
                        order: str = "tp-cp-dp", comm: MPI.Intracomm | None = None,
                        tensor_parallel_mode: str = "1d") -> ParallelState:
    """Create the DP, CP and TP groups and make them the current parallel state.

    Collective over ``comm``: every rank must call it with the same arguments.
    The data-parallel size is ``world_size // (tensor_parallel_size *
    context_parallel_size)``.

    Parameters
    ----------
    tensor_parallel_size : int
        Ranks per tensor-parallel group.
    context_parallel_size : int
        Ranks per context (sequence) parallel group.
    order : str
        Axes ``tp``, ``cp``, ``dp`` innermost first; ``"tp-cp-dp"`` gives
        global rank ``tp + TP*(cp + CP*dp)``.
    comm : mpi4py.MPI.Intracomm, optional
        The communicator to lay out; ``MPI.COMM_WORLD`` by default.
    tensor_parallel_mode : {"1d", "3d"}
        ``"3d"`` also creates the five 3D groups inside each TP group; the TP
        size must then be a cube.

    Returns
    -------
    ParallelState

    Raises
    ------
    ValueError
        For sizes < 1, a world size not divisible by ``tp*cp``, a bad order,
        a non-cube TP size in 3D mode, or ranks passing different arguments.
    RuntimeError
        When a parallel state already exists (call :func:`destroy_parallel`).
    """
    global _state
    comm = MPI.COMM_WORLD if comm is None else comm
    faults.start(comm)  # timed; settings that must agree; a failing rank then ends the job
    arguments = (tensor_parallel_size, context_parallel_size, order, tensor_parallel_mode)
    # Agree first, so a rank with different arguments cannot leave the others
    # waiting inside a Split that it never joins.
    seen = comm.allgather((repr(arguments), _state is not None))
    if len({args for args, _ in seen}) > 1:
        ranks = [r for r, (args, _) in enumerate(seen) if args != seen[0][0]]
        raise ValueError(f"initialize_parallel called with different arguments on ranks "
                         f"{ranks} than on rank 0: {seen[ranks[0]][0]} vs {seen[0][0]}")
    if any(initialized for _, initialized in seen):
        raise RuntimeError("pympar parallel state is already initialized; "
                           "call destroy_parallel() before initializing again")
    sizes = _check_arguments(*arguments, world=comm.Get_size())
    if tensor_parallel_mode == "3d":
        depth = cube_depth(sizes["tp"])
        mesh_sizes = {**{axis: depth for axis in AXES_3D}, "cp": sizes["cp"], "dp": sizes["dp"]}
        mesh_order = "-".join("-".join(AXES_3D) if axis == "tp" else axis
                              for axis in parse_order(order, sizes))
        mesh = Mesh(comm, mesh_sizes, mesh_order)
        tensor_axes: tuple[str, ...] = AXES_3D
    else:
        depth = 0
        mesh = Mesh(comm, sizes, order)
        tensor_axes = ("tp",)
    tensor = mesh.group(*tensor_axes, key="tp")
    context = mesh.group("cp")
    data = mesh.group("dp")
    data_context = mesh.group("dp", "cp")
    groups_3d = make_3d_groups(mesh) if tensor_parallel_mode == "3d" else {}
    _state = ParallelState(mesh, tensor, context, data, data_context,
                           tensor_parallel_mode, depth, groups_3d)
    return _state


def destroy_parallel() -> None:
    """Free every communicator of the current state and forget it; collective.

    Does nothing when no state exists.
    """
    global _state
    if _state is None:
        return
    for group in _state.all_groups():
        group.free()
    _state = None


def is_initialized() -> bool:
    """Return whether :func:`initialize_parallel` has created a current state."""
    return _state is not None


def get_parallel_state() -> ParallelState:
    """Return the current parallel state.

    Raises
    ------
    RuntimeError
        Before :func:`initialize_parallel`.
    """
    if _state is None:
        raise RuntimeError("pympar parallel state is not initialized; "
                           "call pympar.manager.initialize_parallel() first")
    return _state


def get_3d_group(mode: ParallelMode | str) -> Group:
    """Return this rank's 3D group of ``mode`` (e.g. ``"3d_input"``).

    Raises
    ------
    RuntimeError
        Before initialization, or when the state is not in 3D mode.
    """
    state = get_parallel_state()
    if state.tensor_parallel_mode != "3d":
        raise RuntimeError("3D groups need initialize_parallel(..., tensor_parallel_mode='3d'); "
                           f"the current state is {state.tensor_parallel_mode}")
    return state.groups_3d[ParallelMode(mode)]


_AXIS_TITLES = {"tensor": "tensor-parallel", "context": "context (sequence) parallel",
                "data": "data-parallel", "data_context": "data x context parallel"}
_VIEWS: dict[str, tuple[Callable[[Group], object], str]] = {
    "group": (lambda g: g, "the :class:`~pympar.group.Group`"),
    "group_name": (lambda g: g.name, "the name"),
    "rank": (lambda g: g.rank, "this rank's position in"),
    "world_size": (lambda g: g.size, "the size of"),
}


def _getter(axis: str, view: str) -> Callable[[], object]:
    read, what = _VIEWS[view]

    def getter() -> object:
        return read(getattr(get_parallel_state(), axis))

    getter.__name__ = getter.__qualname__ = f"get_{axis}_parallel_{view}"
    getter.__doc__ = (f"Return {what} of this rank's {_AXIS_TITLES[axis]} group.\n\n"
                      "Raises\n------\nRuntimeError\n    Before :func:`initialize_parallel`.\n")
    return getter


get_tensor_parallel_group = _getter("tensor", "group")
get_tensor_parallel_group_name = _getter("tensor", "group_name")
get_tensor_parallel_rank = _getter("tensor", "rank")
get_tensor_parallel_world_size = _getter("tensor", "world_size")
get_context_parallel_group = _getter("context", "group")
get_context_parallel_group_name = _getter("context", "group_name")
get_context_parallel_rank = _getter("context", "rank")
get_context_parallel_world_size = _getter("context", "world_size")
get_data_parallel_group = _getter("data", "group")
get_data_parallel_group_name = _getter("data", "group_name")
get_data_parallel_rank = _getter("data", "rank")
get_data_parallel_world_size = _getter("data", "world_size")
get_data_context_parallel_group = _getter("data_context", "group")
get_data_context_parallel_group_name = _getter("data_context", "group_name")
get_data_context_parallel_rank = _getter("data_context", "rank")
get_data_context_parallel_world_size = _getter("data_context", "world_size")
