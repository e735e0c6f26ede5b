"""pympar: MPI-native data, context, tensor and 3D tensor parallelism for NumPy and CuPy.

Process groups come from one named-axis :class:`~pympar.mesh.Mesh`
(:mod:`pympar.manager`, :mod:`pympar.initializer_3d`); layout mappings move
arrays between layouts (:mod:`pympar.mappings`); layers with hand-written
gradients live in :mod:`pympar.modules`.
"""

__version__ = "0.1.0"

from .group import Group
from .mesh import Mesh, group_ranks
from .manager import (ParallelState, destroy_parallel, get_parallel_state,
                      initialize_parallel, is_initialized)
from .initializer_3d import ParallelMode

__all__ = [
    "__version__",
    "Group",
    "Mesh",
    "group_ranks",
    "ParallelState",
    "ParallelMode",
    "initialize_parallel",
    "destroy_parallel",
    "is_initialized",
    "get_parallel_state",
]
