"""The current parallel state: DP, CP, TP and PP groups cut from one ``Mesh``.

``initialize_parallel`` lays the world out as ``tp x cp x dp x pp`` (innermost first
by default) and creates the tensor, context, data, data-context and pipeline groups once,
collectively. The 16 getters of MindScience's ``distributed.manager`` read that
state, and Megatron's pipeline getters its pipeline group. It is the one piece of
module-level state in pympar.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable
from mpi4py import MPI

from . import backend, faults
from .group import Group, self_group
from .initializer_3d import AXES_3D, ParallelMode, cube_depth, make_3d_groups
from .mesh import Mesh, parse_order
from . import _sizes
from ._sizes import check_arguments, rank_counts_that_fit

__all__ = [
    "ParallelState",
    "initialize_parallel",
    "destroy_parallel",
    "is_initialized",
    "get_parallel_state",
    "get_3d_group",
    "rank_counts_that_fit",
    "resolve_group",
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
    "get_pipeline_model_parallel_group",
    "get_pipeline_model_parallel_group_name",
    "get_pipeline_model_parallel_rank",
    "get_pipeline_model_parallel_world_size",
    "is_pipeline_first_stage",
    "is_pipeline_last_stage",
    "get_pipeline_model_parallel_prev_rank",
    "get_pipeline_model_parallel_next_rank",
]

#: The tensor-parallel modes :func:`initialize_parallel` takes.
TENSOR_PARALLEL_MODES = _sizes.TENSOR_PARALLEL_MODES


@dataclass
class ParallelState:
    """The groups of one parallel layout.

    Attributes
    ----------
    mesh : Mesh
        Axes ``tp``, ``cp``, ``dp`` and, with more than one stage, ``pp`` (in 3D mode
        ``tp`` is split into the cube axes ``tp_i``, ``tp_j``, ``tp_k``, innermost first,
        in its place).
    tensor, context, data, data_context : Group
        This rank's TP, CP, DP and DP x CP groups.
    pipeline : Group
        This rank's pipeline group, its ranks in stage order (this rank alone with one
        stage).
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
    pipeline: Group | None = None

    def all_groups(self) -> list[Group]:
        """Every group of the state, in creation order."""
        return [self.tensor, self.context, self.data, self.data_context,
                *self.groups_3d.values(), *([self.pipeline] if self.pipeline else [])]


_state: ParallelState | None = None


def initialize_parallel(tensor_parallel_size: int = 1, context_parallel_size: int = 1,
                        order: str = "tp-cp-dp", comm: MPI.Intracomm | None = None,
                        tensor_parallel_mode: str = "1d",
                        data_parallel_size: int | None = None,
                        pipeline_parallel_size: int = 1) -> ParallelState:
    """Create the DP, CP, TP and PP groups and make them the current parallel state.

    Collective over ``comm``: every rank must call it with the same arguments (and
    the same settings: ``PYMPAR_DEBUG``, ``PYMPAR_TIMEOUT``).
    The data-parallel size is ``world_size // (tensor_parallel_size *
    context_parallel_size * pipeline_parallel_size)``; pass ``data_parallel_size`` to have it checked, so a script
    written for ``tp * cp * dp`` ranks refuses another rank count instead of silently
    running another data-parallel size.

    Parameters
    ----------
    tensor_parallel_size : int
        Ranks per tensor-parallel group.
    context_parallel_size : int
        Ranks per context (sequence) parallel group.
    order : str
        Axes ``tp``, ``cp``, ``dp`` (and ``pp``) innermost first; ``"tp-cp-dp"`` gives
        global rank ``tp + TP*(cp + CP*dp)``. An order without ``pp`` puts the pipeline
        axis outermost, as Megatron does: ``tp + TP*(cp + CP*(dp + DP*pp))``.
    comm : mpi4py.MPI.Intracomm, optional
        The communicator to lay out; ``MPI.COMM_WORLD`` by default.
    tensor_parallel_mode : {"1d", "3d"}
        ``"3d"`` also creates the five 3D groups inside each TP group; the TP
        size must then be a cube.
    data_parallel_size : int, optional
        The data-parallel size the program expects; ``None`` (the default) takes what the
        world size leaves.
    pipeline_parallel_size : int
        Pipeline stages (:mod:`pympar.pipeline`); each stage's ranks hold their own
        TP x CP x DP layout of its layers.

    Returns
    -------
    ParallelState

    Raises
    ------
    ValueError
        For sizes < 1, a world size not divisible by ``tp*cp`` or other than
        ``tp*cp*dp`` with ``data_parallel_size`` given, a bad order,
        a non-cube TP size in 3D mode, or ranks passing different arguments.
    RuntimeError
        On every rank, when a parallel state already exists on any rank (call
        :func:`destroy_parallel` on every rank first); the message names the ranks that
        still hold one when :func:`destroy_parallel` was called on some ranks only.
    pympar.debug.CollectiveMismatchError
        When other ranks of ``comm`` make another agreed call (a ``Mesh``, say)
        instead.
    pympar.debug.CollectiveTimeoutError
        With ``PYMPAR_TIMEOUT`` set, on the ranks that called it when others did
        not within the timeout. From its first collective on, an uncaught error
        ends the whole job (:mod:`pympar.faults`).
    """
    global _state
    comm = MPI.COMM_WORLD if comm is None else comm
    faults.start(comm)  # timed; settings that must agree; a failing rank then ends the job
    arguments = (tensor_parallel_size, context_parallel_size, order, tensor_parallel_mode,
                 data_parallel_size, pipeline_parallel_size)
    # Agree first, so a rank with different arguments cannot leave the others
    # waiting inside a Split that it never joins.
    seen = comm.allgather((repr(arguments), _state is not None))
    if len({args for args, _ in seen}) > 1:
        ranks = [r for r, (args, _) in enumerate(seen) if args != seen[0][0]]
        raise faults.alike(ValueError(
            f"initialize_parallel called with different arguments on ranks {ranks} than on "
            f"rank 0: {seen[ranks[0]][0]} vs {seen[0][0]}"))
    holding = [rank for rank, (_, initialized) in enumerate(seen) if initialized]
    if len(holding) == len(seen):
        raise faults.alike(RuntimeError("pympar parallel state is already initialized; "
                                        "call destroy_parallel() before initializing again"))
    if holding:
        others = [rank for rank in range(len(seen)) if rank not in holding]
        raise faults.alike(RuntimeError(
            f"initialize_parallel: a parallel state still exists on ranks {holding} but not on "
            f"ranks {others}: destroy_parallel() is collective and was called on some ranks "
            f"only; call it on every rank before initializing again"))
    try:
        sizes, order = check_arguments(*arguments, world=comm.Get_size())
    except ValueError as err:  # the arguments agreed above: every rank raises this alike
        raise faults.alike(err)
    if tensor_parallel_mode == "3d":
        depth = cube_depth(sizes["tp"])
        mesh_sizes = {**{axis: depth for axis in AXES_3D},
                      **{axis: n for axis, n in sizes.items() if axis != "tp"}}
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
    pipeline = mesh.group("pp") if "pp" in sizes else self_group()
    _state = ParallelState(mesh, tensor, context, data, data_context,
                           tensor_parallel_mode, depth, groups_3d, pipeline)
    return _state


def destroy_parallel() -> None:
    """Free every communicator of the current state and forget it; collective.

    The pinned host buffers that stage CuPy arrays are released too
    (:func:`pympar.backend.release_staging`), and the end-of-job hooks of
    :func:`pympar.faults.start` removed.
    """
    global _state
    faults.stop()
    if _state is None:
        return
    for group in _state.all_groups():
        group.free()
    _state = None
    backend.release_staging()


def is_initialized() -> bool:
    """Return whether :func:`initialize_parallel` has created a current state."""
    return _state is not None


def parallel_comm() -> MPI.Intracomm:
    """The communicator of the current parallel state, or ``MPI.COMM_WORLD`` before one exists.

    What every rank of the job agrees over: found-inf flags, checkpoints, preemption.
    """
    return _state.mesh.comm if _state is not None else MPI.COMM_WORLD


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


_KIND = {"tensor": "tensor-parallel", "context": "context-parallel", "data": "data-parallel",
         "data_context": "data x context parallel", "pipeline": "pipeline-parallel"}


def resolve_group(group: Group | None, layer: str, axis: str = "tensor") -> Group:
    """Return ``group``, or this rank's group of ``axis`` in the current parallel state.

    The one place where layers and mappings pick their default group.

    Parameters
    ----------
    group : Group or None
        An explicit group; returned as is.
    layer : str
        Named in the error message (e.g. ``"ColumnParallelLinear"``).
    axis : {"tensor", "context", "data", "data_context", "pipeline"}
        Which group of the current parallel state to use.

    Returns
    -------
    Group

    Raises
    ------
    TypeError
        Naming ``layer`` when ``group`` is neither a Group nor None (a group's
        name, say).
    RuntimeError
        Naming ``layer`` when ``group`` is None and no parallel state exists.
    ValueError
        For an unknown ``axis``.
    """
    if group is not None:
        # The exact type first: it is the hot path of every mapping call.
        if type(group) is Group or isinstance(group, Group):
            return group
        raise TypeError(f"{layer}: group must be a pympar Group or None, not "
                        f"{type(group).__name__} {group!r:.60} (get one from pympar.manager, "
                        f"e.g. get_tensor_parallel_group(), or Mesh.group)")
    if axis not in _KIND:
        raise ValueError(f"{layer}: unknown group axis {axis!r}; expected one of {sorted(_KIND)}")
    if _state is None:
        raise RuntimeError(f"{layer} needs a {_KIND[axis]} group: call "
                           "pympar.manager.initialize_parallel() first or pass group=")
    group_of_axis: Group = getattr(_state, axis)
    return group_of_axis


# The 16 getters of MindScience's distributed.manager, four per group of the current state,
# each with a real return type. Each raises RuntimeError before initialize_parallel.

def _getters(axis: str, words: str, prefix: str | None = None) -> tuple[
        Callable[[], Group], Callable[[], str], Callable[[], int], Callable[[], int]]:
    """``get_<prefix>_parallel_group``, ``_group_name``, ``_rank`` and ``_world_size`` of the
    state's group ``axis`` (``prefix``: ``axis`` unless given, as Megatron's
    ``pipeline_model``)."""
    def group() -> Group:
        return getattr(get_parallel_state(), axis)

    def name() -> str:
        return group().name

    def rank() -> int:
        return group().rank

    def world_size() -> int:
        return group().size

    mine = f"this rank's {words}"
    for getter, suffix, doc in ((group, "group", f"{mine} :class:`~pympar.group.Group`"),
                                (name, "group_name", f"the name of {mine} group"),
                                (rank, "rank", f"this rank's position in its {words} group"),
                                (world_size, "world_size", f"the size of {mine} group")):
        getter.__name__ = getter.__qualname__ = f"get_{prefix or axis}_parallel_{suffix}"
        getter.__doc__ = f"Return {doc}."
    return group, name, rank, world_size


(get_tensor_parallel_group, get_tensor_parallel_group_name, get_tensor_parallel_rank,
 get_tensor_parallel_world_size, get_context_parallel_group, get_context_parallel_group_name,
 get_context_parallel_rank, get_context_parallel_world_size, get_data_parallel_group,
 get_data_parallel_group_name, get_data_parallel_rank, get_data_parallel_world_size,
 get_data_context_parallel_group, get_data_context_parallel_group_name,
 get_data_context_parallel_rank, get_data_context_parallel_world_size) = (
    *_getters("tensor", "tensor-parallel"), *_getters("context", "context (sequence) parallel"),
    *_getters("data", "data-parallel"), *_getters("data_context", "data x context parallel"))


# Megatron's pipeline getters (parallel_state), on the current state's pipeline group.

(get_pipeline_model_parallel_group, get_pipeline_model_parallel_group_name,
 get_pipeline_model_parallel_rank, get_pipeline_model_parallel_world_size) = _getters(
    "pipeline", "pipeline", "pipeline_model")


def is_pipeline_first_stage() -> bool:
    """Return whether this rank runs the first stage (the one that reads the data)."""
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage() -> bool:
    """Return whether this rank runs the last stage (the one that computes the loss)."""
    group = get_pipeline_model_parallel_group()
    return group.rank == group.size - 1


def get_pipeline_model_parallel_prev_rank() -> int:
    """Return the global rank of the previous stage, wrapping around at the first (as
    Megatron's does; :class:`pympar.pipeline.PipelineGroup` says None there)."""
    group = get_pipeline_model_parallel_group()
    return int(group.ranks[(group.rank - 1) % group.size])


def get_pipeline_model_parallel_next_rank() -> int:
    """Return the global rank of the next stage, wrapping around at the last (as
    Megatron's does)."""
    group = get_pipeline_model_parallel_group()
    return int(group.ranks[(group.rank + 1) % group.size])
