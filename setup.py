"""Builds mergelab's one C extension, the compiled merge loops (mergelab/merge/accelerator/_loops.c); every
other setting is in pyproject.toml. Without a C compiler the package still installs and the
merges run the plain torch methods (mergelab.merge.accelerator.enabled() says which is active)."""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# Exact float32 rounding as torch: no contraction of a*b+c into an FMA by the compiler, no
# reordering (no -ffast-math); fmaf as the CPU instruction (no errno), and selects whose both
# sides the vectoriser may evaluate (no trapping math: nothing reads the FP exception flags).
UNIX_FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math"]
MSVC_FLAGS = ["/O2", "/fp:precise"]


class BuildLoops(build_ext):
    def build_extensions(self) -> None:
        flags = MSVC_FLAGS if self.compiler.compiler_type == "msvc" else UNIX_FLAGS
        for extension in self.extensions:
            extension.extra_compile_args = flags
        super().build_extensions()


setup(
    ext_modules=[
        Extension(
            "mergelab.merge.accelerator._loops",
            ["mergelab/merge/accelerator/_loops.c"],
            optional=True,
        )
    ],
    cmdclass={"build_ext": BuildLoops},
)
