"""Layers with hand-written backward, parameters and deterministic sharded initialization."""

from .core import Module, Parameter, Sequential
from .init import (
    InitMethod,
    bias_init,
    get_init_method,
    init_weight_block,
    initialize_affine_weight,
    kaiming_uniform,
    normal,
    partition_indices,
    partition_slices,
    uniform,
    xavier_normal,
    xavier_uniform,
    zeros,
)
from .linear import Linear
from .activations import GELU, Dropout, ReLU
from .normalization import LayerNorm
from .losses import MSELoss, SoftmaxCrossEntropy
from .parallel_linear import ColumnParallelLinear, RowParallelLinear
from .layers_3d import LayerNorm3D, Layout3D, Linear3D, layout_3d
from .attention import DistributedAttention, ParallelAttention
from .blockwise import sequence_segments
from .context_attention import ContextAttention, split_context_group

__all__ = [
    "Parameter",
    "Module",
    "Sequential",
    "Linear",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "Linear3D",
    "LayerNorm3D",
    "Layout3D",
    "layout_3d",
    "DistributedAttention",
    "ParallelAttention",
    "ContextAttention",
    "split_context_group",
    "sequence_segments",
    "GELU",
    "ReLU",
    "Dropout",
    "LayerNorm",
    "SoftmaxCrossEntropy",
    "MSELoss",
    "InitMethod",
    "initialize_affine_weight",
    "init_weight_block",
    "bias_init",
    "partition_slices",
    "partition_indices",
    "get_init_method",
    "xavier_uniform",
    "xavier_normal",
    "kaiming_uniform",
    "normal",
    "uniform",
    "zeros",
]
