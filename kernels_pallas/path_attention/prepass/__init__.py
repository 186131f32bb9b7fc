"""The transport pre-pass: per chunk, the UT transform and the operands the attention kernels
read (q^, k^, E, the in-chunk logits), as Pallas kernels (kernels.py) or in batched jnp
(reference.py, also their oracle)."""
