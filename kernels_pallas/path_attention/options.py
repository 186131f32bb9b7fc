"""BlockSizes: the few choices a caller may make for the PaTH / FoX kernels. Everything else (which
forward and backward run, the lanes, the warps and stages of every launch) follows from these,
the shapes and the device, in one plan (plan.py) that `explain(...)` prints.

Each option is here because its values win somewhere (DESIGN.md, "Options"): the tile size, the
span of the span-parallel forms, the pre-pass form, the Mosaic GPU launches, and what the
pre-pass keeps from its forward for its backward (time against memory).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping

PREPASS = ("uz", "split", "jnp")       # BlockSizes.prepass
KEEP_INVERSE = (False, True, "bf16")   # BlockSizes.keep_inverse


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Options of the PaTH / FoX kernels; None means "the plan decides".

  block: the chunk of the transport, which is also the query and the key tile (tokens); a power
    of two >= 16. The Mosaic GPU launches take 64 only.
  span: chunks per span of the span-parallel forward and backward (even); 0 runs the
    sequential walks; None: the plan's, by the number of chunks and head_dim.
  prepass: the transport pre-pass's backward form: "uz" (two kernels, from dU and dZ), "split"
    (three kernels) or "jnp" (batched jnp, no kernel); None: "uz" at head_dim <= 64 with 16-bit
    inputs, else "split", and "jnp" where no pre-pass kernel fits the GPU's shared memory.
  mosaic: the far walks and the near sweep of the span forms as Mosaic GPU launches (Hopper);
    None: wherever they take the operands on a Hopper GPU; True: wherever they take the operands
    (in the interpreter their jnp oracles run); False: Triton only.
  keep_inverse: what the pre-pass keeps of its per-chunk inverse Y for its backward: "bf16"
    (its bf16 rounding, refined there by one Newton step; where the products are bf16 halves,
    elsewhere as False), True (float32: one kernel less, twice the bytes) or False (recomputed).
  """
  block: int = 64
  span: int | None = None
  prepass: str | None = None
  mosaic: bool | None = None
  keep_inverse: bool | str = "bf16"

  def __post_init__(self):
    if not isinstance(self.block, int) or self.block < 16 or self.block & (self.block - 1):
      raise ValueError(f"block={self.block!r} must be a power of two >= 16")
    if self.span is not None and (not isinstance(self.span, int) or self.span < 0
                                  or self.span % 2):
      raise ValueError(f"span={self.span!r} must be None (the plan's), 0 (the sequential walks) "
                       "or a positive even number of chunks")
    if self.prepass not in (None,) + PREPASS:
      raise ValueError(f"prepass={self.prepass!r} must be None or one of {PREPASS}")
    if self.mosaic not in (None, False, True):
      raise ValueError(f"mosaic={self.mosaic!r} must be None, True or False")
    if not any(self.keep_inverse is k or self.keep_inverse == k for k in KEEP_INVERSE) or \
        isinstance(self.keep_inverse, int) and not isinstance(self.keep_inverse, bool):
      raise ValueError(f"keep_inverse={self.keep_inverse!r} must be one of {KEEP_INVERSE}")

  @classmethod
  def of(cls, options) -> BlockSizes:
    """BlockSizes from a BlockSizes, a mapping of its fields (a dict or an ml_collections
    ConfigDict), a "key=value,..." string, or None (the defaults). An unknown field raises one
    error naming the valid ones."""
    if options is None:
      return cls()
    if isinstance(options, cls):
      return options
    if isinstance(options, str):
      options = parse(options)
    if hasattr(options, "to_dict"):   # ml_collections.ConfigDict
      options = options.to_dict()
    if not isinstance(options, Mapping):
      raise ValueError(f"kernel options must be a BlockSizes, a dict or 'key=value,...', got "
                       f"{type(options).__name__}")
    fields = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(options) - set(fields))
    if unknown:
      raise ValueError(f"unknown kernel option{'s' * (len(unknown) > 1)} "
                       f"{', '.join(unknown)}; the options are {', '.join(fields)}")
    # None: the default (a config's unset field); strings as parse() reads them ("true", "8")
    given = {k: _literal(v) if isinstance(v, str) else v for k, v in options.items()}
    return cls(**{k: v for k, v in given.items() if v is not None})


def parse(text: str) -> dict:
  """"span=8,mosaic=false,prepass=split" -> {"span": 8, "mosaic": False, "prepass": "split"}:
  integers, true / false / none, else strings."""
  out = {}
  for item in filter(None, (s.strip() for s in text.split(","))):
    key, eq, value = item.partition("=")
    if not eq or not key:
      raise ValueError(f"kernel option {item!r} is not KEY=VALUE")
    out[key.strip()] = _literal(value)
  return out


def _literal(value: str):
  low = value.strip().lower()
  if low.lstrip("-").isdigit():
    return int(low)
  return {"true": True, "false": False, "none": None}.get(low, value.strip())
