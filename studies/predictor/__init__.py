"""Studies of the response-length predictor: what chose the shipped adapter's recipe.

Run from the repository root: `python -m studies.predictor --help`.  The
product (`predictor/`) imports nothing from here; README.md lists each
study's command, report and figures.

probe.py       heads on frozen features: which layers and prompt format carry RL
scaling.py     CPU scaling study (depth, LoRA layers, prompt length, epochs, data)
capacity.py    GPU capacity study: variants chosen on a validation slice, winner tested
ceiling.py     same-prompt ceiling of ShareGPT's recorded answers
ensemble.py    seed ensembles assembled from separate training runs
collect.py     served-completion records produced with the served model
__main__.py    `python -m studies.predictor --help`
"""
