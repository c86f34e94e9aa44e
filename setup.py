"""The one part of the build pyproject.toml cannot declare stably: the optional C kernels.

compression/kernels.c holds fused bitmap passes loaded with ctypes (compression/native.py;
no Python API in them). ``optional``: without a C compiler the install goes on and numpy's
passes serve. -ffp-contract=off keeps t + v * alpha rounded twice, as torch's index_add_.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "gossipgrad.compression._kernels",
            sources=["compression/kernels.c"],
            extra_compile_args=["-O3", "-ffp-contract=off"],
            optional=True,
        )
    ]
)
