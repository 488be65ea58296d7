"""Only the compiled kernels live here; everything else is in setup.cfg."""
from setuptools import Extension, setup

# optional: without a C compiler the install still works, and selection and summing fall back
# to torch kernels (tests/test_select_kernel.py and tests/test_sparse_sum.py fail loudly where
# they should have been built)
setup(ext_modules=[Extension("adtopk_ps.compression._fibre", ["adtopk_ps/compression/_fibre.c"],
                             extra_compile_args=["-O3"], optional=True),
                   Extension("server._sparse_sum", ["server/_sparse_sum.c"],
                             extra_compile_args=["-O3"], optional=True)])
