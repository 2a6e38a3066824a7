"""XLA:CPU flags for the subprocesses the tests start on tiny models, where compiling dominates the run time:
LLVM at -O0 and without its expensive passes. Both sides of an equality a test checks run under the same flags
(they change code generation, not the program XLA computes). Used as `XLA_FLAGS=... + CHEAP_COMPILE_FLAGS`."""

CHEAP_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
