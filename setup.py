"""The build step for the one C extension, `storage_backends._pageio`; the rest of the
project is described in pyproject.toml.

The extension is optional: where it cannot be built (no C compiler or Python headers, or not
Linux), the install goes on and the file backend reads and frames pages in Python
(`storage_backends/native.py` says which is in use).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "storage_backends._pageio",
            ["storage_backends/_pageio.c"],
            extra_compile_args=["-O3", "-std=gnu11", "-pthread"],
            extra_link_args=["-pthread"],
            optional=True,
        )
    ]
)
