"""bertjax: BERT (Devlin et al., 2018) in JAX/Flax, faithful by default, fast by design."""

from bertjax.runtime import backend_env as _backend_env

# Before any JAX backend starts (`backend_env`): on a host without an accelerator, JAX starts
# on the CPU without the installed plugins' (libtpu, CUDA) start-up tracebacks (JAX_PLATFORMS,
# if set, decides); on an NVIDIA host, cuDNN's fused attention stays out of XLA's CUDA graphs.
_backend_env.prepare()
