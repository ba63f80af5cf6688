"""Builds the one C extension; everything else is declared in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "ankusa_shm._atomics",
            sources=["ankusa_shm/_atomics.c"],
            extra_compile_args=["-O2", "-Wall", "-Werror"],
        )
    ]
)
