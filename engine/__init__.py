"""Model execution: models, paged KV cache, attention backends, sampler, runner.

Import what you need from the submodules (`engine.runner.ModelRunner`,
`engine.sampling_params.SamplingParams`, ...); this package file stays
empty so that importing e.g. the sampling parameters does not pull in torch.
"""
