"""Response-length (RL) predictor (EconoServe §2.3, §3.3.2).

config.py      data, model and training settings (ModelConfig is saved with an adapter)
dataset.py     ShareGPT and served-completion (prompt, RL) pairs, the 10K/70-30 split
model.py       backbone (OPT / Llama) + LoRA (peft) + length head, save/load
prefix_cache.py  cached outputs of the frozen bottom layers (CPU training budget)
train.py       seeded, resumable fine-tuning loop with a learning curve
evaluate.py    MAE / Acc-50 / Acc-100 / padding figures against two baselines
metrics.py     the metric and baseline definitions
retrain.py     online retraining on served completions, before/after report
service.py     inference wrapper used by deployments/predictor.py (CPU or CUDA)
ensemble.py    adapters of other seeds on one shared frozen prefix, averaged
prompt_format.py  the chat frame around a truncated prompt
fit_head.py    `fit-head`: the engine's length head fitted on a model's answers
cli_args.py    argument groups of the command line
__main__.py    `python -m predictor --help`
adapters/      the shipped adapter (the files the server loads)

The studies that chose the shipped recipe live in studies/predictor/ (repository only).
"""
