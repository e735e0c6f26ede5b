"""Distributed FFTs of fields split over process groups, each with its exact adjoint.

A *field* is an n-d array cut into blocks over one group (a *slab*: ``axes[0]`` split) or
over several (a *pencil*: ``axes[i]`` split over ``groups[i]``), by the balanced rule of
:mod:`pympar.partition`; uneven extents are fine. :data:`rfftn`, :data:`irfftn`,
:data:`fftn` and :data:`ifftn` equal NumPy's functions of the gathered field, ``norm=``
included; the spectrum stays in the transposed layout (``axes[i + 1]`` split over
``groups[i]``, as mpi4py-fft leaves it), and the inverse takes it back. Each is a
forward/backward pair like the mappings of :mod:`pympar.mappings`: ``F.backward`` is the
adjoint of ``F``, so a layer can put an FFT in its forward and the adjoint in its backward.

Every transpose is one :func:`pympar.collectives.all_to_all` (one MPI call, its agreement
check included); the local transforms are FFTW's through pyFFTW when installed, else
``scipy.fft``'s at ``workers=1`` when SciPy is installed, else NumPy's, and ``cupy.fft``'s for
CuPy arrays (see :mod:`pympar.fft._local` for why). ``out=`` takes a reused array for the
result; the intermediates live in the group's reused scratch arrays.

Examples
--------
>>> from mpi4py import MPI
>>> import numpy, pympar
>>> from pympar import fft
>>> g = pympar.Mesh(MPI.COMM_WORLD, {"x": MPI.COMM_WORLD.Get_size()}).group("x")
>>> shape = (16, 12, 10)
>>> u = fft.physical_placement(shape, g).take(numpy.ones(shape))
>>> spectrum = fft.rfftn(u, g, s=shape)      # axis 1 split now, axis 0 whole
>>> back = fft.irfftn(spectrum, g, s=shape)  # axis 0 split again
>>> bool(numpy.allclose(back, u))
True
"""

from .transforms import (FFTPair, fftn, ifftn, irfftn, physical_placement, rfftn,
                         spectral_placement, spectral_shape)

__all__ = ["FFTPair", "rfftn", "irfftn", "fftn", "ifftn", "physical_placement",
           "spectral_placement", "spectral_shape"]
