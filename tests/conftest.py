"""Test setup: 8 fake CPU devices so sharded code runs as on a pod slice, and one persistent
compilation cache per test process (an xdist worker), since many tests compile the same
tiny models' steps again (a resumed run, the same config in another test)."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # (after the environment it reads)

_CACHE = tempfile.mkdtemp(prefix="bertjax_test_jax_cache_")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
# The same cache for the `python -m bertjax.*` processes that tests start (their own setting
# wins where they set one).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

# The files that take longest (measured with --durations=0), started first so that the two
# xdist workers of `-n 2 --dist loadfile` finish together. Every other file follows in the
# usual order.
LONGEST_FIRST = (
    "test_cli.py",
    "test_faults.py",
    "test_model.py",
    "test_train.py",
    "test_guards.py",
    "test_steps.py",
    "test_multihost.py",
    "test_dropout.py",
    "test_attention_impl.py",
    "test_convert.py",
    "test_exports.py",
    "test_checkpoint.py",
    "test_finetune.py",
    "test_bench.py",
)


def pytest_configure(config) -> None:
    if hasattr(config.option, "loadscopereorder"):  # xdist: keep LONGEST_FIRST's order, not
        config.option.loadscopereorder = False  # its own (files by number of tests)


def pytest_collection_modifyitems(items: list) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
