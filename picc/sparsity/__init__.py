"""Which FFN neurons fire, and how picc knows per token: the analyses behind the sparsity passes.

* :mod:`.calib` -- calibration text (PTB splits or the user's files) as token windows;
* :mod:`.profiling` -- how often each neuron is active, thresholds for a target sparsity
  (driven by the ``profile-activations`` pass);
* :mod:`.fisher` -- per-neuron importance scales, so one threshold serves every layer;
* :mod:`.predictors` and :mod:`.predictor_store` -- PowerInfer's low-rank predictors, trained
  and cached (driven by the ``insert-predictors`` pass);
* :mod:`.sparsify` -- ``picc sparsify``: the target sparsity and the pipeline of the two passes;
* :mod:`.evaluation` -- perplexity and agreement of a sparse module against its dense model.
"""

FISHER_TOKENS = 2048
"""How many calibration tokens the Fisher scales' gradients are taken on by default (the profile
takes all of them): SmolLM2 at 30% gate-first, PTB valid, +2.07% perplexity against +2.03% from
all 4096 (+2.17% from 1024), for two forwards' work a token instead of three. Here, not in
:mod:`.fisher`, so that the command line's ``--help`` needs no numpy."""
