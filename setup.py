"""Only the compiled kernels live here; everything else is in setup.cfg."""
from setuptools import Extension, setup

INDEX_TYPES = ["adtopk_ps/core/_index_types.h"]  # (included by the kernels that read positions)

# optional: without a C compiler the install still works, and selection, summing and decoding
# fall back to torch kernels (tests/test_select_kernel.py, tests/test_sparse_sum.py,
# tests/test_payload_decoding.py and tests/test_position_checks.py fail loudly where they should have been built)
setup(ext_modules=[Extension("adtopk_ps.compression._fibre", ["adtopk_ps/compression/_fibre.c"],
                             extra_compile_args=["-O3"], optional=True),
                   Extension("server._sparse_sum", ["server/_sparse_sum.c"], depends=INDEX_TYPES,
                             extra_compile_args=["-O3"], optional=True),
                   Extension("adtopk_ps.wire._positions", ["adtopk_ps/wire/_positions.c"],
                             depends=INDEX_TYPES, extra_compile_args=["-O3"], optional=True),
                   Extension("adtopk_ps.core._sparse_write", ["adtopk_ps/core/_sparse_write.c"],
                             depends=INDEX_TYPES, extra_compile_args=["-O3"], optional=True)])
