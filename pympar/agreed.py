"""What every rank must pass alike: the inventory of the agreement, call by call.

pympar's promise is that ranks calling with different arguments get a clear error on every
rank, never a silently wrong result. :data:`INVENTORY` lists every public call that
communicates and, for each of its parameters, how the promise is kept (:class:`Agreed`):

``label``
    In the call's agreement: compared in its one check (:mod:`pympar._agreement`), as part
    of the collective's signature, the call's label or a layer's label and agreement key.
``checked``
    Checked otherwise, as said (an exchange of its own, a refusal in the check, ...).
``local``
    Rank-local on purpose, as said (it shapes only this rank's own output, or it is data).
``group``
    Names the ranks taking part. The check runs over it, so it cannot compare it: a rank
    in another group meets other ranks' checks, or waits for the watchdog.

:data:`SETTINGS` does the same for the environment variables pympar reads, and
:data:`OUTSIDE` names the public callables of :data:`MODULES` left out, with why (they
communicate nothing, or they are the agreement itself); :data:`MODULES_OUTSIDE` the modules
whose public calls are none of these. ``tests/test_agreement_inventory.py`` fails when a
parameter of an inventoried call is in no list (or listed but gone), when a public callable
is neither inventoried nor outside, and, for every ``label`` or ``checked`` entry, unless
the call with that argument different on one rank raises on every rank. This module is
data: it imports nothing, and no call reads it.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Agreed", "KINDS", "INVENTORY", "SETTINGS", "OUTSIDE", "MODULES",
           "MODULES_OUTSIDE", "table"]

#: The kinds of :class:`Agreed`, and what each means.
KINDS = {
    "label": "in the call's agreement check (its signature, label or layer key)",
    "checked": "checked otherwise, as said",
    "local": "rank-local on purpose, as said",
    "group": "names the ranks that agree (the check runs over it)",
}


class Agreed(NamedTuple):
    """How one parameter (or setting) is agreed: a kind of :data:`KINDS` and how, or why."""

    kind: str
    how: str


def _label(how: str) -> Agreed:
    return Agreed("label", how)


def _checked(how: str) -> Agreed:
    return Agreed("checked", how)


def _local(why: str) -> Agreed:
    return Agreed("local", why)


def _group(how: str = "the ranks taking part") -> Agreed:
    return Agreed("group", how)


Calls = dict[str, dict[str, Agreed]]

# ----------------------------------------------------------------------- collectives
_COLL = "pympar.collectives."
_X = _label("its dtype and its extents but the gathered one are in the signature; its values "
            "are the data")
_OUT = _checked("a misfit out is refused by its rank in the check (every rank raises); "
                "a fitting one changes nothing but where the result is written")
_CALL_LABEL = _label("compared with the signature (inside any enclosing label block)")
_OP = _label("in the signature")
_SIZES = _label("given: in the signature, each checked against its rank's block; not given: "
                "the check compares 'sizes unknown', then the extents are exchanged")
_COLLECTIVES: Calls = {
    _COLL + "all_reduce": {"group": _group(), "x": _X, "op": _OP, "out": _OUT,
                           "label": _CALL_LABEL},
    _COLL + "broadcast": {"group": _group(), "x": _X, "root": _label("in the signature"),
                          "out": _OUT, "label": _CALL_LABEL},
    _COLL + "all_gather": {"group": _group(), "x": _X, "axis": _label("in the signature"),
                           "out": _OUT, "sizes": _SIZES, "label": _CALL_LABEL},
    _COLL + "reduce_scatter": {"group": _group(), "x": _X,
                               "axis": _label("in the signature"), "out": _OUT, "op": _OP,
                               "label": _CALL_LABEL},
    _COLL + "all_to_all": {"group": _group(), "x": _X,
                           "split_axis": _label("in the signature"),
                           "concat_axis": _label("in the signature"), "out": _OUT,
                           "sizes": _SIZES, "label": _CALL_LABEL},
}

# ----------------------------------------------------------------------- mappings
# name, forward step, backward step: "all_reduce", "reduce_scatter", "gather", "all_to_all",
# "reduce_scatter_or_keep", or None for a step that sends nothing.
_MAPPINGS = (
    ("copy_to_all", None, "all_reduce"),
    ("reduce_from_all", "all_reduce", None),
    ("scatter_to_hidden", None, "gather"),
    ("gather_from_hidden", "gather", None),
    ("reduce_scatter_to_hidden", "reduce_scatter", "gather"),
    ("scatter_to_sequence", None, "gather"),
    ("gather_from_sequence", "gather", "reduce_scatter_or_keep"),
    ("reduce_scatter_to_sequence", "reduce_scatter", "gather"),
    ("all_to_all_from_sequence_to_hidden", "all_to_all", "all_to_all"),
    ("all_to_all_from_hidden_to_sequence", "all_to_all", "all_to_all"),
)
_GLOBAL_SIZE = _label("the block sizes it gives are in the gather's signature; a value that "
                      "does not fit this rank's block is refused in the check")
_NO_GLOBAL_SIZE = _checked("refused (TypeError: the step gathers nothing) in the step's "
                           "check: every rank raises")
_AXIS_OPTION = _label("the split and gathered axes are in the all-to-all's signature")
_KEEP = _checked("True reduce-scatters; False keeps this rank's block after a check of its own "
                 "(label, dtype, shape): ranks that differ meet in different checks and raise")


def _mapping(step: str) -> dict[str, Agreed]:
    entry = {"x": _X, "group": _group("the current TP group (CP for the all-to-all pair) "
                                      "when None"),
             "out": _OUT,
             "global_size": _GLOBAL_SIZE if step in ("gather", "all_to_all")
             else _NO_GLOBAL_SIZE}
    if step == "all_to_all":
        entry.update(seq_axis=_AXIS_OPTION, head_axis=_AXIS_OPTION)
    if step == "reduce_scatter_or_keep":
        entry["tensor_parallel_output_grad"] = _KEEP
    return entry


_MAPPING_CALLS: Calls = {}
_SENDS_NOTHING: dict[str, str] = {}
for _name, _forward, _backward in _MAPPINGS:
    for _direction, _step in (("__call__", _forward), ("backward", _backward)):
        _path = f"pympar.mappings.{_name}.{_direction}"
        if _step is None:
            _SENDS_NOTHING[_path] = ("sends nothing: its result is this rank's input or its "
                                     "block of it, so an argument changes only this rank's "
                                     "own result, as another input would")
        else:
            _MAPPING_CALLS[_path] = _mapping(_step)

# ----------------------------------------------------------------------- FFTs
_FFT_CALLS: Calls = {}
for _name in ("rfftn", "irfftn", "fftn", "ifftn"):
    for _direction in ("__call__", "backward"):
        _FFT_CALLS[f"pympar.fft.{_name}.{_direction}"] = {
            "x" if _direction == "__call__" else "dy": _label(
                "its dtype and extents are in the exchanges' signature, the whole axes' "
                "extents in their label"),
            "groups": _group("the groups that split the field (a slab: one; a pencil: two)"),
            "axes": _label("in the exchanges' label (and their split and gathered axes)"),
            "norm": _label("in the exchanges' label (None is 'backward'): it only scales the "
                           "local transforms"),
            "s": _label("in the exchanges' label: lengths 2k and 2k + 1 give one spectrum"),
            **({"out": _checked("refused before the exchanges when its dtype or (with s=) "
                                "shape is wrong: every rank raises")}
               if _direction == "__call__" else {}),
        }

# ----------------------------------------------------------------------- halo
_HALO = "pympar.halo.HaloExchange."
_PADDED = _label("its dtype and leading extents are in the exchange's check; a misfit is "
                 "refused there")
_HALO_CALLS: Calls = {
    _HALO + "__init__": {
        "decomposition": _checked("made collectively (its shape, grid and periodicity "
                                  "agreed); the halo's check repeats the global shape"),
        "width": _label("the widths are in the halo's check when made"),
        "faces": _label("in the halo's check when made"),
    },
    _HALO + "forward": {"x": _PADDED, "out": _checked(
        "a misfit out is refused in the check: every rank raises")},
    _HALO + "backward": {"dy": _PADDED, "out": _local(
        "where this rank's block of the result goes: written after the exchange, a misfit "
        "raises ValueError on this rank alone, its own result")},
    _HALO + "exchange": {"padded": _PADDED},
    _HALO + "adjoint": {"padded": _PADDED},
    _HALO + "refuse": {
        "what": _local("the call in words, for the messages"),
        "error": _checked("this rank joins the neighbours' check refusing: those raise the "
                          "mismatch naming it, and it raises its own error"),
    },
}
_DECOMPOSITION_CALLS: Calls = {
    "pympar.decomposition.Decomposition.__init__": {
        "global_shape": _label("in the check made over every split axis's group"),
        "groups": _group("the groups that split the axes; the neighbours check they form a "
                         "grid"),
        "periodic": _label("in the check made over every split axis's group"),
    },
}

# ----------------------------------------------------------------------- layers
_M = "pympar.modules."
_IN = _label("in the layer's label (Module.label_calls), compared in every forward's and "
             "backward's agreement")
_INIT = _label("the init (seed, methods) is compared in every agreement "
               "(Module.label_calls' agreed, described_init)")
_XP = _local("where this rank's parameters live: NumPy and CuPy arrays move alike")
_INPUT_GRAD = _label("compared in the backward's agreement (input_grad=False makes fewer "
                     "collectives)")
_DTYPE = _IN
_INPUT = _label("the layer's agreement compares its dtype and its extents except those split "
                "over the group")
_DY = _label("the backward's agreement compares its dtype and its extents except the split "
             "ones")
_DBIAS = _local("the gradient of the bias this rank returned (skip_bias_add): data, as dy's "
                "values")
_KEY_LENGTHS = _label("a checksum of the key lengths is in the forward's agreement")
_TP = _group("the tensor-parallel group (the current one when None)")
_LINEAR = {"in_features": _IN, "out_features": _IN, "bias": _IN, "skip_bias_add": _IN,
           "use_sequence_parallel": _IN, "init_method": _INIT, "bias_init": _INIT,
           "dtype": _DTYPE, "group": _TP, "seed": _INIT, "xp": _XP, "input_grad": _INPUT_GRAD}
_LAYOUT = _group("the cube's groups (the current 3D state's when None); their axes are "
                 "agreed with swap")
_SWAP = _label("the groups' axes are compared in every agreement (Layout3D.axes)")
_SPECTRAL = _label("in the label of every collective of the layer, which their checks "
                   "compare (SpectralConv._label)")
_SPATIAL = _group("the spatial group that splits x1 (None: one rank)")
_LAYERS: Calls = {
    _M + "ColumnParallelLinear.__init__": {**_LINEAR, "gather_output": _IN, "stride": _IN},
    _M + "ColumnParallelLinear.forward": {"x": _INPUT},
    _M + "ColumnParallelLinear.backward": {"dy": _DY, "dbias": _DBIAS},
    _M + "RowParallelLinear.__init__": {**_LINEAR, "input_is_parallel": _IN},
    _M + "RowParallelLinear.forward": {"x": _INPUT},
    _M + "RowParallelLinear.backward": {"dy": _DY, "dbias": _DBIAS},
    _M + "VocabParallelEmbedding.__init__": {
        "num_embeddings": _IN, "embedding_dim": _IN, "use_sequence_parallel": _IN,
        "init_method": _INIT, "dtype": _DTYPE, "group": _TP, "seed": _INIT, "xp": _XP},
    _M + "VocabParallelEmbedding.forward": {
        "ids": _label("the forward's agreement compares their dtype and shape, and whether "
                      "a rank refused them (an id outside the vocabulary); their values are "
                      "the data, the same on every rank")},
    _M + "VocabParallelEmbedding.backward": {"dy": _DY},
    _M + "VocabParallelCrossEntropy.__init__": {
        "vocab_size": _IN, "label_smoothing": _IN, "ignore_index": _IN, "dtype": _DTYPE,
        "group": _TP},
    _M + "VocabParallelCrossEntropy.forward": {
        "logits": _INPUT,
        "target": _label("its shape and dtype are in the forward's agreement (extra), and "
                         "whether a rank refused it (a class outside the vocabulary); its "
                         "values are the data, the same on every rank")},
    _M + "Linear3D.__init__": {
        "in_features": _IN, "out_features": _IN, "bias": _IN, "swap": _SWAP,
        "init_method": _INIT, "dtype": _DTYPE, "seed": _INIT, "layout": _LAYOUT, "xp": _XP,
        "input_grad": _INPUT_GRAD},
    _M + "Linear3D.forward": {"x": _INPUT},
    _M + "Linear3D.backward": {"dy": _DY},
    _M + "LayerNorm3D.__init__": {
        "hidden": _IN, "eps": _IN, "swap": _SWAP, "dtype": _DTYPE, "layout": _LAYOUT,
        "xp": _XP, "input_grad": _INPUT_GRAD},
    _M + "LayerNorm3D.forward": {"x": _INPUT},
    _M + "LayerNorm3D.backward": {"dy": _DY},
    _M + "ParallelAttention.__init__": {
        **dict.fromkeys(("hidden", "use_sequence_parallel", "bias"), _label(
            "in the labels of its projections (ColumnParallelLinear, RowParallelLinear)")),
        "num_heads": _IN, "group": _TP, "dtype": _DTYPE,
        "seed": _label("its projections' inits (seed, seed + 1) are in their agreements"),
        "xp": _XP, "causal": _IN, "input_grad": _INPUT_GRAD},
    _M + "ParallelAttention.forward": {"x": _INPUT, "key_lengths": _KEY_LENGTHS},
    _M + "ParallelAttention.backward": {"dy": _DY},
    _M + "ContextAttention.__init__": {
        "hidden": _IN, "num_heads": _IN, "scheme": _IN,
        "group": _group("the context-parallel group (the current one when None)"),
        "ulysses_size": _label("in the label (the Ulysses groups' size); split_context_group "
                               "agrees on it first"),
        "groups": _group("the Ulysses and ring groups, checked against group (ValueError on "
                         "every rank); their sizes are in the label"),
        "causal": _IN, "layout": _IN, "bias": _IN, "dtype": _DTYPE, "seed": _INIT, "xp": _XP,
        "input_grad": _INPUT_GRAD},
    _M + "ContextAttention.forward": {"x": _INPUT, "key_lengths": _KEY_LENGTHS},
    _M + "ContextAttention.backward": {"dy": _DY},
    _M + "DistributedAttention.__init__": {
        "hidden": _IN, "num_heads": _IN,
        "group": _group("the context-parallel group (the current one when None)"),
        "bias": _IN, "dtype": _DTYPE, "seed": _INIT, "xp": _XP, "causal": _IN,
        "input_grad": _INPUT_GRAD},
    _M + "split_context_group": {
        "group": _group("the context-parallel group to split"),
        "ulysses_size": _checked("compared in a check over group before the split: every "
                                 "rank raises")},
    _M + "Laplacian.__init__": {
        "halo": _checked("the halo exchange agreed when made; its exchanges run under the "
                         "layer's label"),
        "spacing": _label("in the label its exchanges run under (it only scales the local "
                          "stencil)")},
    _M + "Laplacian.forward": {"u": _PADDED},
    _M + "Laplacian.backward": {"dy": _PADDED},
    _M + "HaloConv.__init__": {
        "halo": _checked("the halo exchange agreed when made; its exchanges run under the "
                         "layer's label"),
        **dict.fromkeys(("in_channels", "out_channels", "kernel_size", "bias", "dtype",
                         "seed"), _label("in the label its exchanges and reductions run "
                                         "under")),
        "xp": _XP,
        "input_grad": _label("in the backward's check (HaloConv.backward's key)")},
    _M + "HaloConv.forward": {"x": _PADDED},
    _M + "HaloConv.backward": {"dy": _label("refused in the check when it does not fit; the "
                                            "adjoint's check compares its dtype")},
    _M + "SpectralConv.__init__": {
        "in_channels": _SPECTRAL, "out_channels": _SPECTRAL, "modes": _SPECTRAL,
        "group": _SPATIAL, "dtype": _SPECTRAL, "seed": _SPECTRAL, "xp": _XP,
        "input_grad": _label("in the backward's labels (input_grad=False: one exchange "
                             "fewer)")},
    _M + "SpectralConv.forward": {"x": _label(
        "refused in the check when it does not fit the layer; its dtype, batch and whole "
        "extents are in the exchanges' check (the grid in their label)")},
    _M + "SpectralConv.backward": {"dy": _label(
        "refused in the check when it does not fit the forward's output; its dtype and "
        "extents are in the exchanges' check")},
    _M + "SpectralBlock.__init__": {
        **dict.fromkeys(("channels", "modes", "dims", "dtype"),
                        _label("in its spectral layer's labels (dims: the number of modes)")),
        "group": _SPATIAL,
        "activation": _label("in the block's label, which its spectral layer's collectives "
                             "run under"),
        "seed": _label("in its spectral layer's labels (the pointwise layer's is seed + 1)"),
        "xp": _XP,
        "input_grad": _label("in its spectral layer's backward labels")},
    _M + "SpectralBlock.forward": {"x": _label("as SpectralConv.forward's")},
    _M + "SpectralBlock.backward": {"dy": _label("as SpectralConv.backward's")},
}
# SpectralConv1d and SpectralConv3d share SpectralConv2d's constructor (a private class's).
_LAYERS[_M + "SpectralConv2d.__init__"] = _LAYERS[_M + "SpectralConv.__init__"]

# ----------------------------------------------------------------------- training
_TRAINING: Calls = {
    "pympar.optim.allreduce_gradients": {
        "module_or_params": _checked("each bucket's label carries a checksum of its members' "
                                     "layout (flat_label): other parameters raise"),
        "group": _group("the data-parallel group (None: nothing to do)"),
        "bucket_bytes": _checked("the buckets' labels name their members: a bound that cuts "
                                 "other buckets raises, one that cuts the same ones changes "
                                 "nothing"),
        "average": _label("in each bucket's label"),
    },
    "pympar.zero.ZeroRedundancyOptimizer.__init__": {
        "params": _checked("shapes and dtypes all-gathered when made (ValueError on every "
                           "rank); names and layout in the buckets' labels"),
        "optimizer_class": _checked("its type is compared in every step's check"),
        "group": _group("the group the state is sharded over (default_group when None)"),
        "bucket_bytes": _checked("the buckets' labels name their members: a bound that cuts "
                                 "other buckets raises at the first step"),
        "kw": _checked("the wrapped optimizer's hyperparameters are compared in every step's "
                       "check (they may change between steps)"),
    },
    "pympar.zero.ZeroRedundancyOptimizer.step": {
        "grad_scale": _checked("compared in the step's check with the hyperparameters and "
                               "the frozen parameters"),
    },
    "pympar.amp.GradScaler.__init__": {
        "init_scale": _checked("every step's all-reduce carries the scale (max of it and of "
                               "its negation): ranks holding another raise"),
        **dict.fromkeys(("growth_factor", "backoff_factor", "growth_interval", "enabled"),
                        _label("in the label of every step's all-reduce")),
        "comm": _group("the ranks the overflow verdict is agreed over (the parallel state's "
                       "world when None)"),
    },
    "pympar.amp.GradScaler.step": {
        "optimizer": _local("each rank steps its own optimizer (its shard): the overflow "
                            "verdict is agreed, a ZeRO step agrees its own"),
    },
}

# ----------------------------------------------------------------------- checkpoints
_CKPT_COMM = _group("the ranks taking part (the current parallel state's, else the world)")
_CHECKPOINT: Calls = {
    "pympar.checkpoint.save": {
        **dict.fromkeys(("path", "step", "keep"), _checked(
            "compared in one exchange first (CheckpointError on every rank)")),
        "model": _checked("its tensors' names, full shapes and dtypes are compared first (a "
                          "part of a model, a pipeline stage: with the same names elsewhere)"),
        "optimizer": _checked("its type and hyperparameters are compared first, its tensors "
                              "with the model's; its step counts are rank 0's"),
        "extra": _local("rank 0's value is saved, by design (any JSON the program needs)"),
        "comm": _CKPT_COMM,
    },
    "pympar.checkpoint.load": {
        "path": _checked("compared in one exchange first (CheckpointError on every rank)"),
        "model": _checked("every rank's tensors are checked against the manifest; any "
                          "rank's failure raises on every rank"),
        "optimizer": _checked("its type is compared in one exchange first"),
        "comm": _CKPT_COMM,
    },
}

# ----------------------------------------------------------------------- pipeline
_PP = "pympar.pipeline."
_PIPE = _group("the pipeline group: its rank s runs stage s")
_HEADER = _checked("in every message's header, compared by the neighbour receiving it: it "
                   "raises CollectiveMismatchError and tells its neighbours, which raise it "
                   "too, along the pipeline")
_WHEN_MADE = _checked("compared over the pipeline group when the schedule is made "
                      "(settings.check_same: CollectiveMismatchError on every rank), and in "
                      "every message's header")
_RECEIVED = _local("the array module of the array returned: the bytes received are the same")
_PIPELINE: Calls = {
    _PP + "StageTransfer.__init__": {"pipeline": _PIPE, "label": _HEADER},
    _PP + "StageTransfer.send_forward": {
        "x": _local("the activation is data: its shape and dtype travel in the header, and "
                    "the next stage learns them (micro-batches may be uneven)"),
        "micro_batch": _HEADER},
    _PP + "StageTransfer.recv_forward": {"micro_batch": _HEADER, "xp": _RECEIVED},
    _PP + "StageTransfer.send_backward": {
        "dx": _checked("its shape and dtype travel in the header: the previous stage compares "
                       "them with the activation it sent (CollectiveMismatchError on every "
                       "stage)"),
        "micro_batch": _HEADER},
    _PP + "StageTransfer.recv_backward": {"micro_batch": _HEADER, "xp": _RECEIVED},
    _PP + "split_stages": {
        "layers": _checked("their number is compared over the pipeline group "
                           "(settings.check_same) before any is built; each stage's layers "
                           "agree their own calls"),
        "pipeline": _PIPE,
        "balance": _checked("compared over the pipeline group (settings.check_same)")},
    _PP + "PipelineSchedule.__init__": {
        "stage": _local("this rank's layers: each agrees its own calls, and the activations "
                        "they exchange are checked by the transfers"),
        "pipeline": _PIPE, "micro_batches": _WHEN_MADE, "axis": _WHEN_MADE,
        "loss": _checked("the last stage refuses a missing one in the comparison made when "
                         "the schedule is made (every stage raises); the others ignore it"),
        "xp": _RECEIVED, "label": _WHEN_MADE},
    _PP + "PipelineSchedule.run": {
        "inputs": _local("the first stage's data (the others ignore it)"),
        "targets": _local("the last stage's data (the others ignore it)"),
        "loss_scale": _local("scales this pipeline's loss gradient; GradScaler.step agrees "
                             "the scale over every rank")},
}

#: Every public call that communicates -> its parameters -> how each is agreed.
INVENTORY: Calls = {**_COLLECTIVES, **_MAPPING_CALLS, **_FFT_CALLS, **_HALO_CALLS,
                    **_DECOMPOSITION_CALLS, **_LAYERS, **_TRAINING, **_CHECKPOINT,
                    **_PIPELINE}

#: The environment variables pympar reads -> how each is agreed.
SETTINGS: dict[str, Agreed] = {
    **dict.fromkeys(("PYMPAR_DEBUG", "PYMPAR_TIMEOUT"), _checked(
        "compared when a mesh, group or parallel state is made (pympar.settings): ValueError "
        "on every rank; switched later on some ranks only (debug.enable, set_timeout), it is "
        "not compared again")),
    "PYMPAR_CUDA_AWARE": _local("how this rank's device buffers reach MPI, directly or "
                                "through host memory: the data moved are the same"),
    "PYMPAR_STOP_FILE": _local("the file this rank watches; Preemption.should_stop agrees "
                               "the verdict, so every rank stops together"),
    "PYMPAR_PLAN_MACHINE": _local("where the layout planner keeps this machine's "
                                  "calibration: the planner runs before any job and "
                                  "communicates nothing"),
}

_SERIAL = "a serial layer: communicates nothing"
_NOTHING = "communicates nothing"
_AGREEMENT = "the agreement itself (it makes the checks this inventory lists)"
_PLAIN_STEP = ("updates this rank's parameters only: between data-parallel replicas the "
               "hyperparameters are not compared (ZeroRedundancyOptimizer.step compares them)")

#: Public callables of :data:`MODULES` that are not inventoried, and why.
OUTSIDE: dict[str, str] = {
    **{_COLL + n: _AGREEMENT for n in ("label", "agree", "refuse")},
    **{_COLL + n: _NOTHING for n in ("balanced_sizes", "block_slice",
                                     "large_counts_supported")},
    "pympar.mappings.Mapping.__init__": _NOTHING,
    "pympar.mappings.Mapping.__call__": "the path of every mapping, inventoried per mapping",
    **{f"pympar.mappings.{n}.__init__": "a layout value: communicates nothing"
       for n in ("Replicated", "Sharded", "Partial")},
    **_SENDS_NOTHING,
    "pympar.fft.FFTPair.__init__": _NOTHING,
    "pympar.fft.FFTPair.__call__": "inventoried per transform (pympar.fft.fftn.__call__, ...)",
    "pympar.fft.FFTPair.backward": "inventoried per transform (pympar.fft.fftn.backward, ...)",
    **{f"pympar.fft.{n}": _NOTHING for n in ("physical_placement", "spectral_placement",
                                             "spectral_shape")},
    "pympar.decomposition.agree_all": _AGREEMENT,
    "pympar.decomposition.check_all": _AGREEMENT,
    **{_M + n: _NOTHING for n in (
        "Parameter.__init__", "Layout3D.__init__", "layout_3d", "sequence_segments",
        "split_parameters", "initialize_affine_weight", "bias_init", "init_shard",
        "init_bias", "get_init_method", "xavier_uniform", "xavier_normal", "kaiming_uniform",
        "normal", "uniform", "zeros")},
    _M + "Module.__init__": _NOTHING,
    _M + "Module.__call__": "calls forward, inventoried per layer",
    _M + "Module.forward": "the base class's (it raises NotImplementedError)",
    _M + "Module.backward": "the base class's (it raises NotImplementedError)",
    **{_M + f"{n}.{m}": "a container: each layer inside agrees its own calls"
       for n in ("Sequential", "Recompute") for m in ("__init__", "forward", "backward")},
    **{_M + f"{n}.{m}": _SERIAL for n in ("Linear", "GELU", "ReLU", "LayerNorm",
                                          "SoftmaxCrossEntropy", "MSELoss")
       for m in ("__init__", "forward", "backward")},
    _M + "VocabParallelCrossEntropy.backward": "communicates nothing: this rank's block of "
                                               "the softmax from the forward, scaled by grad",
    **{_M + f"Dropout.{m}": "communicates nothing: its mask is drawn from this rank's own "
       "stream (seed, rank)" for m in ("__init__", "forward", "backward")},
    "pympar.optim.Optimizer.__init__": _NOTHING,
    "pympar.optim.Optimizer.step": "the base class's (it raises NotImplementedError)",
    **{f"pympar.optim.{n}.{m}": (_NOTHING if m == "__init__" else _PLAIN_STEP)
       for n in ("SGD", "Adam", "AdamW") for m in ("__init__", "step")},
    "pympar.optim.flat_label": _NOTHING,
    **{f"pympar.zero.{n}": _NOTHING for n in ("default_group", "per_param_state",
                                             "share_rows")},
    "pympar.amp.master_weights_optimizer": "an optimizer over this rank alone (a group of "
                                           "one): communicates nothing",
    "pympar.amp.self_group": "a group of this rank alone: no message",
    "pympar.checkpoint.latest": "not collective: reads this rank's view of the directory",
    _PP + "PipelineGroup.__init__": "rank arithmetic on a group: communicates nothing",
    _PP + "as_pipeline": _NOTHING,
    _PP + "stage_bounds": _NOTHING,
    _PP + "PipelineStage.__init__": _NOTHING,
    **{_PP + n: "moves a stage's own caches: communicates nothing"
       for n in ("Caches.__init__", "take_caches", "put_caches", "check_consumed")},
}

#: The modules whose public callables are inventoried or :data:`OUTSIDE`.
MODULES = ("pympar.collectives", "pympar.mappings", "pympar.fft", "pympar.halo",
           "pympar.decomposition", "pympar.modules", "pympar.optim", "pympar.zero",
           "pympar.amp", "pympar.checkpoint", "pympar.pipeline")

_SETTINGS_AGREEMENT = ("made under the job-settings agreement (pympar.settings), which "
                       "compares what every rank passed")
#: The other public modules of pympar, and why their calls are not inventoried.
MODULES_OUTSIDE = {
    "pympar.agreed": "this inventory",
    "pympar.backend": _NOTHING, "pympar.partition": _NOTHING, "pympar.errors": _NOTHING,
    "pympar.debug": "the watchdog and the mismatch report (its settings: SETTINGS)",
    "pympar.stats": _NOTHING,
    "pympar.group": "Group's collectives are pympar.collectives'; a group is made by a mesh",
    "pympar.settings": "the job-settings agreement itself",
    "pympar.mesh": _SETTINGS_AGREEMENT, "pympar.manager": _SETTINGS_AGREEMENT,
    "pympar.initializer_3d": _SETTINGS_AGREEMENT,
    "pympar.faults": "how a job ends: an error raised alike, or an abort",
    "pympar.pmi": "reads the launcher's environment once per rank",
    "pympar.memory": _NOTHING,
    "pympar.preemption": "should_stop agrees its verdict over the world",
    "pympar.launch": "command lines: starts a job, before any group",
    "pympar.plan": "predictions, made without MPI; its calibration is a job of its own",
}


def table(calls: Calls | None = None) -> str:
    """The inventory as a reStructuredText list table (for the documentation): one row per
    parameter, with the call, its kind and how it is agreed."""
    calls = INVENTORY if calls is None else calls
    lines = [".. list-table::", "   :header-rows: 1", "   :widths: 30 18 10 42", "",
             "   * - call", "     - parameter", "     - kind", "     - how"]
    for path, params in calls.items():
        for i, (name, agreed) in enumerate(params.items()):
            call = f"``{path.removeprefix('pympar.')}``" if i == 0 else ""
            lines += [f"   * - {call}", f"     - ``{name}``", f"     - {agreed.kind}",
                      f"     - {agreed.how}"]
    return "\n".join(lines)


def settings_table() -> str:
    """:data:`SETTINGS` as a reStructuredText list table."""
    lines = [".. list-table::", "   :header-rows: 1", "   :widths: 30 10 60", "",
             "   * - variable", "     - kind", "     - how"]
    for name, agreed in SETTINGS.items():
        lines += [f"   * - ``{name}``", f"     - {agreed.kind}", f"     - {agreed.how}"]
    return "\n".join(lines)


del _name, _forward, _backward, _direction, _step, _path
__doc__ += ("\nThe inventory\n-------------\n\n" + table() + "\n\nThe settings\n------------\n\n"
            + settings_table() + "\n")
