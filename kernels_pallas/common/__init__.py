"""What every kernel family builds on: launches (pallas_call per backend, padding, shape
checks), the GPU's approximate special functions, and the shared tile functions."""
