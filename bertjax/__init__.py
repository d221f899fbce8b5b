"""bertjax: BERT (Devlin et al., 2018) in JAX/Flax, faithful by default, fast by design."""
from bertjax import console as _console

# As quiet as the entry points (which call it again in `configure_console`): on a host
# without an accelerator, JAX starts on the CPU without the installed plugins' (libtpu, CUDA)
# start-up tracebacks; JAX_PLATFORMS, if set, decides.
_console.cpu_unless_accelerated()
