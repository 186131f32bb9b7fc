"""Mosaic GPU launches (Hopper: TMA, wgmma) for the span forms' heaviest walks: the far keys of
the span forward (forward_far), the far dq and far dk/dv walks of the span backward
(backward_far) and its near sweep (span_sweep). Each has a jnp oracle beside it, which the
interpreter runs in its place."""
