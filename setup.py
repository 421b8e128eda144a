"""The build step for the one C extension, `storage_backends._pageio`; the rest of the
project is described in pyproject.toml.

The extension is required: it is the only implementation of the page checksum, of the check
of a stored object and of the file backend's batch reads and writes (`storage_backends/
native.py`). Where it cannot be built the install fails, saying why and what to install.
"""

import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

_NEEDS = (
    "storage_backends._pageio, the C extension hicache's storage backends run on, could not "
    "be built: {why}. It needs Linux, a C compiler and Python's headers (Debian/Ubuntu: "
    "apt-get install gcc libc6-dev python3-dev)."
)


class BuildPageio(build_ext):
    """build_ext that names what is missing instead of a compiler's traceback alone."""

    def run(self) -> None:
        if not sys.platform.startswith("linux"):
            raise SystemExit(_NEEDS.format(why=f"this is {sys.platform}, not Linux (preadv2)"))
        try:
            super().run()
        except Exception as exc:  # the compiler's own message was printed above
            raise SystemExit(_NEEDS.format(why=f"{type(exc).__name__}: {exc}")) from exc

    def build_extension(self, ext) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:
            raise SystemExit(_NEEDS.format(why=f"{type(exc).__name__}: {exc}")) from exc


setup(
    ext_modules=[
        Extension(
            "storage_backends._pageio",
            ["storage_backends/_pageio.c"],
            extra_compile_args=["-O3", "-std=gnu11", "-pthread"],
            extra_link_args=["-pthread"],
        )
    ],
    cmdclass={"build_ext": BuildPageio},
)
