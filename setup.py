"""posenc-jax: position encodings beyond RoPE in JAX (PaTH, GRAPE, accumulated rotations, TAPA)."""
import setuptools

setuptools.setup(
    name="posenc-jax",
    version="0.1.0",
    description="Position encodings beyond RoPE for JAX: PaTH, GRAPE, accumulated rotations, TAPA.",
    # experiments.benchmarks is run from a checkout (its tables are in docs/benchmarks/), not
    # installed: the library does not carry the measurement scripts.
    packages=setuptools.find_packages(
        include=["posenc_jax*", "kernels_pallas*", "experiments*"],
        exclude=["experiments.benchmarks", "experiments.benchmarks.*"]),
    python_requires=">=3.11",
    install_requires=[
        "jax>=0.10",
        "flax>=0.12",
        "optax>=0.2.4",
        "orbax-checkpoint>=0.11",
        "grain>=0.2.10",
        "ml-collections>=1.0",
        "chex>=0.1.90",
        "absl-py",
        "numpy",
        "tensorboardX",
        "matplotlib",
        "tqdm",
    ],
    # parity: transformers as the reference in tests/test_transformers_parity.py (CPU, seconds);
    # kept out of "test" so that CI's clean install stays small. tokenizers (no torch) is in
    # "test" so that CI runs the tokenizer.json tests (tests/test_tokenizer.py).
    extras_require={"test": ["pytest>=8", "pytest-xdist", "tokenizers"],
                    "parity": ["torch", "transformers>=5"]},
)
