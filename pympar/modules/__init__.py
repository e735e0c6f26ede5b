"""Layers with hand-written backward, parameters and deterministic sharded initialization."""

from .core import Module, Sequential
from .parameter import Parameter
from .init_methods import (
    InitMethod,
    get_init_method,
    kaiming_uniform,
    normal,
    uniform,
    xavier_normal,
    xavier_uniform,
    zeros,
)
from .sharded_init import bias_init, init_bias, init_shard, initialize_affine_weight
from .linear import Linear
from .activations import GELU, Dropout, ReLU
from .normalization import LayerNorm
from .losses import MSELoss, SoftmaxCrossEntropy
from .parallel_linear import ColumnParallelLinear, RowParallelLinear
from .vocab_parallel import VocabParallelCrossEntropy, VocabParallelEmbedding
from .layers_3d import LayerNorm3D, Layout3D, Linear3D, layout_3d
from .attention import DistributedAttention, ParallelAttention
from .blockwise import sequence_segments
from .context_attention import ContextAttention, split_context_group
from .recompute import Recompute
from .stencil import HaloConv, Laplacian
from .spectral import SpectralConv, SpectralConv1d, SpectralConv2d, SpectralConv3d
from .fno import SpectralBlock, split_parameters

__all__ = [
    "Parameter",
    "Module",
    "Sequential",
    "Linear",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "VocabParallelCrossEntropy",
    "Linear3D",
    "LayerNorm3D",
    "Layout3D",
    "layout_3d",
    "DistributedAttention",
    "ParallelAttention",
    "ContextAttention",
    "split_context_group",
    "sequence_segments",
    "Recompute",
    "Laplacian",
    "HaloConv",
    "SpectralConv",
    "SpectralConv1d",
    "SpectralConv2d",
    "SpectralConv3d",
    "SpectralBlock",
    "split_parameters",
    "GELU",
    "ReLU",
    "Dropout",
    "LayerNorm",
    "SoftmaxCrossEntropy",
    "MSELoss",
    "InitMethod",
    "initialize_affine_weight",
    "bias_init",
    "init_shard",
    "init_bias",
    "get_init_method",
    "xavier_uniform",
    "xavier_normal",
    "kaiming_uniform",
    "normal",
    "uniform",
    "zeros",
]
