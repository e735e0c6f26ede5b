"""Every argument the inventory calls agreed really is: one rank's differs, every rank raises.

For each entry of :mod:`pympar.agreed` classified ``label`` or ``checked`` (and each such
setting), its case (agreement_cases.py, agreement_layer_cases.py) makes the call with that
argument different on the last rank, on fresh groups, under a short watchdog: every rank
must raise a clear error (:class:`~pympar.errors.CollectiveMismatchError` naming what each
rank passed, or a ``ValueError``, ``TypeError`` or ``CheckpointError``: the same on every
rank, or a rank's own refusal of its argument while the others raise the mismatch naming
it), never time out or return. An agreed entry without a case fails.
"""

from __future__ import annotations

import os

import pytest

from agreement_cases import Context
from agreement_pipeline_cases import CASES  # every case: the layers' and pipeline's too
from mpi_helpers import WORLD, agree
from pympar import agreed, debug, manager
from pympar.checkpoint import CheckpointError
from pympar.debug import CollectiveMismatchError, CollectiveTimeoutError
from pympar.errors import PeerEndedError

#: The watchdog's timeout in the cases: a rank left waiting fails the case within it.
TIMEOUT = 30.0
CLEAR = (CollectiveMismatchError, ValueError, TypeError, CheckpointError)

#: Calls checked with the neighbours only (a halo exchange's, see pympar._halo_check): on the
#: cases' 1-D decomposition the last rank and its neighbour raise, and the ranks beyond raise
#: PeerEndedError (a neighbour that raised told them) or return with their faces right.
NEIGHBOUR_CHECKED = ("pympar.halo.HaloExchange.forward", "pympar.halo.HaloExchange.backward",
                     "pympar.halo.HaloExchange.exchange", "pympar.halo.HaloExchange.adjoint",
                     "pympar.halo.HaloExchange.refuse",
                     "pympar.modules.Laplacian.", "pympar.modules.HaloConv.")

AGREED = sorted([(path, param) for path, params in agreed.INVENTORY.items()
                 for param, entry in params.items() if entry.kind in ("label", "checked")]
                + [("settings", name) for name, entry in agreed.SETTINGS.items()
                   if entry.kind in ("label", "checked")])


def test_every_agreed_entry_has_a_case():
    missing = [f"{path}: {param}" for path, param in AGREED if (path, param) not in CASES]
    assert not missing, "agreed entries without a mismatch case:\n" + "\n".join(missing)
    stale = sorted(set(CASES) - set(AGREED))
    assert not stale, f"cases of entries that are not agreed: {stale}"


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("path,param", AGREED, ids=[f"{p}:{a}" for p, a in AGREED])
def test_an_argument_that_differs_on_one_rank_raises_on_every_rank(path, param, shared_dir):
    run = CASES.get((path, param))
    if run is None:
        pytest.fail(f"no case for {path}: {param} (see test_every_agreed_entry_has_a_case)")
    folder = os.path.join(shared_dir, f"{path}-{param}")
    manager.destroy_parallel()
    debug.disable()
    debug.set_timeout(TIMEOUT)
    ctx = Context(folder)
    caught = None
    try:
        run(ctx)
    except pytest.skip.Exception:
        raise
    except Exception as err:  # noqa: BLE001 - the test inspects whatever was raised
        caught = err
    finally:
        debug.set_timeout(TIMEOUT)  # a settings case changed it on one rank
        try:
            ctx.close()
        finally:
            debug.set_timeout(None)
            debug.disable()
    clear = isinstance(caught, CLEAR) and not isinstance(caught, CollectiveTimeoutError)
    neighbours_only = path.startswith(NEIGHBOUR_CHECKED)
    if neighbours_only and WORLD.rank < WORLD.size - 2:  # beyond the last rank's neighbour
        clear = clear or caught is None or isinstance(caught, PeerEndedError)
    agree(clear, f"{path} with {param} different on the last rank: "
                 f"{'no error' if caught is None else repr(caught)[:400]}")
    if neighbours_only:
        return
    kinds = WORLD.allgather(type(caught).__name__)
    # Alike, or one rank refusing its own argument (pympar.decomposition.agree_all raises
    # it there) while the others raise the mismatch naming that refusal.
    own = set(kinds) - {"CollectiveMismatchError"}
    agree(len(own) <= 1 and (len(set(kinds)) == 1 or "refused by this rank" in str(caught)
                             or not isinstance(caught, CollectiveMismatchError)),
          f"{path}: {param}: the ranks raised {kinds}: {caught}")
