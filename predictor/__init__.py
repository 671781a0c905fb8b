"""Response-length (RL) predictor (EconoServe §2.3, §3.3.2).

dataset.py     ShareGPT and served-completion (prompt, RL) pairs, the 10K/70-30 split
model.py       backbone (OPT / Llama) + LoRA (peft) + length head, save/load
prefix_cache.py  cached outputs of the frozen bottom layers (CPU training budget)
train.py       seeded, resumable fine-tuning loop with a learning curve
evaluate.py    MAE / Acc-50 / Acc-100 / padding figures against two baselines
metrics.py     the metric and baseline definitions
retrain.py     online retraining on served completions, before/after report
collect.py     served-completion records produced with the served model
service.py     inference wrapper used by deployments/predictor.py (CPU or CUDA)
ensemble.py    adapters of other seeds on one shared frozen prefix, averaged
prompt_format.py  chat frame and the length-perception instruction
probe.py       heads on frozen features: which layers and prompt format carry RL
scaling.py     CPU scaling study (depth, LoRA layers, prompt length, epochs, data)
capacity.py    GPU capacity study: variants chosen on a validation slice, winner tested
ceiling.py     same-prompt ceiling of ShareGPT's recorded answers
__main__.py    `python -m predictor --help`
"""
