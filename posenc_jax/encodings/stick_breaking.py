"""The stick-breaking entry (docs/encodings/stick_breaking.md#stick-breaking-attention): `sba`.

No positional transform of q, k or v and no parameters: position enters through the
stick-breaking weights themselves (posenc_jax.stick_breaking), which favour nearer keys.
Hyperparameters, keyword-only:
  attend_current  False (default): query i breaks the stick over keys j < i; True: j <= i.
  remainder       "current" (default): the leftover stick r_i weights the query's own value
                  v_i; "none": it is dropped, so o_i = sum_j A_ij v_j with sum_j A_ij < 1.
The defaults are the authors' models' (their training code adds r_i v_i; their kernel's
attend_current defaults to False).
"""
from __future__ import annotations

from posenc_jax import stick_breaking
from posenc_jax.encodings import Prepared
from posenc_jax.encodings import register
from posenc_jax.encodings import resolve_hparams
from posenc_jax.encodings import split_layer_args

HPARAMS = {"sba": dict(attend_current=False, remainder="current")}


def _init(key, dims, **hp):
  del key, dims
  stick_breaking.check_options(**resolve_hparams("sba", hp, HPARAMS["sba"]))
  return {}


def _prepare(params, **kw):
  del params
  layer, hp = split_layer_args(kw)
  hp = resolve_hparams("sba", hp, HPARAMS["sba"])
  stick_breaking.check_options(**hp)
  return Prepared("stick_breaking", layer["q"], layer["k"], layer["v"], hp)


register("sba", family="stick_breaking", init=_init, prepare=_prepare)
