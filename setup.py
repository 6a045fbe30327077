"""The one C extension: the router's KV index (services/meshllm/router/kv/_blockcore.c; everything else is in
pyproject.toml). Optional: without a C compiler and Python's headers the install goes on, and routers use the
Python index (same answers, ~3x the memory), saying so in their log."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "meshllm.router.kv._blockcore",
            sources=["services/meshllm/router/kv/_blockcore.c"],
            depends=[f"services/meshllm/router/kv/_blockcore_{h}.h" for h in ("store", "convert", "walk")],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]
)
