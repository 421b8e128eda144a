"""The build step for the one C extension, `storage_backends._pageio`; the rest of the
project is described in pyproject.toml.

The extension is optional: it is the file:// backend's batch reader and writer (and a faster
check and framing of pages for every backend; `storage_backends/native.py`). Where it cannot
be built (no C compiler, no Python headers, no xxHash header, not Linux) the install still
succeeds, with a warning naming what to install; memory://, redis:// and grpc:// then run on
`storage_backends/portable.py`, and file:// says what it needs when opened.
"""

import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

_SKIPPED = (
    "WARNING: storage_backends._pageio, the C extension of the file:// backend, was not built "
    "({why}); memory://, redis:// and grpc:// work without it, file:// does not. It needs "
    "Linux, a C compiler, Python's headers and the xxHash library's header (Debian/Ubuntu: "
    "apt-get install gcc libc6-dev python3-dev libxxhash-dev); then reinstall."
)


class BuildPageio(build_ext):
    """build_ext that, where the extension cannot be built, warns and names what is missing
    instead of failing the install (the compiler's own message is printed above it)."""

    def run(self) -> None:
        if not sys.platform.startswith("linux"):
            self._skip(f"this is {sys.platform}, not Linux (preadv2)")
            return
        try:
            super().run()
        except Exception as exc:
            self._skip(f"{type(exc).__name__}: {exc}")

    def build_extension(self, ext) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:
            self._skip(f"{type(exc).__name__}: {exc}")

    def _skip(self, why: str) -> None:
        print(_SKIPPED.format(why=why), file=sys.stderr)


setup(
    ext_modules=[
        Extension(
            "storage_backends._pageio",
            [
                "storage_backends/_pageio.c",
                "storage_backends/_xxh3_avx2.c",
                "storage_backends/_xxh3_avx512.c",
            ],
            depends=["storage_backends/_xxh3_wide.h"],
            extra_compile_args=["-O3", "-std=gnu11", "-pthread"],
            extra_link_args=["-pthread"],
            optional=True,
        )
    ],
    cmdclass={"build_ext": BuildPageio},
)
