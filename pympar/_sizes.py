"""The sizes of a parallel layout: what ``initialize_parallel`` checks before any group
exists, and what it says when a layout does not fit the job (private to the manager)."""

from __future__ import annotations

from .initializer_3d import cube_depth
from .mesh import check_sizes, parse_order

#: The tensor-parallel modes (one axis, or the 3D cube).
TENSOR_PARALLEL_MODES = ("1d", "3d")


def rank_counts_that_fit(model: int, world: int) -> str:
    """What to run instead when ``world`` ranks do not split into groups of ``model``, in
    words: the nearest rank counts that fit, and the group sizes that fit ``world``.

    Parameters
    ----------
    model : int
        Ranks per model replica (tensor x context x pipeline parallel sizes).
    world : int
        The ranks the job has.

    Returns
    -------
    str
        E.g. ``"run it on a multiple of 2 ranks (mpiexec -n 2 or -n 4), or use sizes whose
        product divides 3 (1 or 3)"``.
    """
    below = world // model * model
    counts = " or ".join(f"-n {n}" for n in (below, below + model) if n > 0)
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    shown = ", ".join(map(str, divisors[:-1])) + f" or {divisors[-1]}" if len(divisors) > 1 \
        else "1"
    return (f"run it on a multiple of {model} ranks (mpiexec {counts}), or use sizes whose "
            f"product divides {world} ({shown})")


def check_arguments(tensor_parallel_size: int, context_parallel_size: int, order: str,
                     tensor_parallel_mode: str, data_parallel_size: int | None,
                     pipeline_parallel_size: int, world: int) -> tuple[dict[str, int], str]:
    """The mesh's sizes (``pp`` only with more than one stage) and its order (``pp``
    outermost unless ``order`` places it), or ValueError."""
    sizes = check_sizes({"tp": tensor_parallel_size, "cp": context_parallel_size,
                         "pp": pipeline_parallel_size})
    product = (f"tensor_parallel_size {sizes['tp']} x context_parallel_size {sizes['cp']}"
               + (f" x pipeline_parallel_size {sizes['pp']}" if sizes["pp"] > 1 else ""))
    model = sizes["tp"] * sizes["cp"] * sizes["pp"]
    if data_parallel_size is not None:
        expected = model * check_sizes({"dp": data_parallel_size})["dp"]
        if world != expected:
            raise ValueError(f"{product} x data_parallel_size {data_parallel_size} needs "
                             f"{expected} ranks, and this job has {world}: run it on "
                             f"{expected} ranks (mpiexec -n {expected}), or leave "
                             "data_parallel_size out to use what the job has")
    if tensor_parallel_mode not in TENSOR_PARALLEL_MODES:
        raise ValueError(f"tensor_parallel_mode must be one of {TENSOR_PARALLEL_MODES}, "
                         f"not {tensor_parallel_mode!r}")
    if world % model:
        raise ValueError(f"world size {world} is not divisible by {product} = {model}: "
                         f"{rank_counts_that_fit(model, world)}")
    pp = sizes.pop("pp")
    sizes["dp"] = world // model
    if pp > 1:  # Megatron's place for it: outermost, unless the order says otherwise
        sizes["pp"] = pp
        if "pp" not in [t.strip() for t in str(order).split("-")]:
            order = f"{order}-pp" if order else "pp"
    parse_order(order, sizes)
    if tensor_parallel_mode == "3d":
        cube_depth(sizes["tp"])
    return sizes, order
