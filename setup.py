"""Only the compiled selection kernel lives here; everything else is in setup.cfg."""
from setuptools import Extension, setup

# optional: without a C compiler the install still works, and selection falls back to
# torch kernels (tests/test_select_kernel.py fails loudly where it should have been built)
setup(ext_modules=[Extension("adtopk_ps.compression._fibre", ["adtopk_ps/compression/_fibre.c"],
                             extra_compile_args=["-O3"], optional=True)])
